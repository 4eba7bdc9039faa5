"""The web stack (``server``: Starlette on uvicorn with the server's limits) and the deletion-request intake
(``intake``: ``hf-unlearn requests web``). Needs the ``web`` extra: ``pip install hf_unlearn[web]``."""
