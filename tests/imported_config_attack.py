"""A user's configuration module, read from the environment when imported (``import cfg; cfg.CLIP`` in a callback):
for tests/test_trace_import_attacks.py."""

import os

CLIP = os.environ.get("HFU_TEST_IMP_MODULE")
