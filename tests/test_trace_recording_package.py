"""The recording engine's rooms: one job per module of the hooks (hf_unlearn.trace.recorder), the public names kept at
their old path (hf_unlearn.trace.recording), and nothing of the engine below the public recording importing it."""

import ast
from pathlib import Path

import hf_unlearn.trace as trace

TRACE = Path(trace.__file__).parent
RECORDER = TRACE / "recorder"

# Every public name the single-module hf_unlearn/trace/recording.py offered, and the module that owns it now.
MOVED = {
    "TraceRecordingMixin": "recording", "TraceRecordingTrainer": "recording",
    "trace_recording": "recording", "TraceWriter": "writer", "microbatch_seed": "seeds", "rank_seed": "seeds",
    "seeded": "rng", "peft_and_base": "model_info", "frozen_parameters": "model_info",
    "dropout_settings": "model_info", "dynamic_rope": "model_info", "first_non_finite": "model_info",
    "recorded_trainer_class": "trainers", "optimizer_spec": "recorder.optimizers",
    "build_optimizer": "recorder.optimizers", "SameOptimizerSettings": "recorder.optimizers",
    "keyed_batch_digest": "recorder.segments", "dummy_row": "recorder.slots", "dummy_has_weight": "recorder.slots",
    "IGNORE_INDEX": "recorder.slots", "GUARD_CHECKS": "recorder.program", "PATH_ARGS": "recorder.header",
    "HUB_ID_OR_PATH": "recorder.header", "PROCESS_LOCAL_ARGS": "recorder.launch",
}


def _imports(path: Path) -> set[str]:
    """The hf_unlearn.trace modules ``path`` imports, at the top or inside a function."""
    package = path.relative_to(TRACE.parent.parent).with_suffix("").parts[:-1]  # a module's or __init__'s folder
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_every_public_name_keeps_its_path_and_is_the_object_its_new_module_owns():
    import importlib

    import hf_unlearn.trace.recording as recording

    for name, home in MOVED.items():
        owner = importlib.import_module(f"hf_unlearn.trace.{home}")
        assert getattr(recording, name) is getattr(owner, name), name
    assert set(MOVED) <= set(recording.__all__)


def test_nothing_of_the_trace_engine_below_the_recording_imports_it():
    def importers(name):
        return sorted(p.relative_to(TRACE).as_posix() for p in TRACE.rglob("*.py")
                      if RECORDER not in p.parents and any(m == name or m.startswith(name + ".") for m in _imports(p)))

    # the hooks: the replay engine builds on them, the public recording adds the end-of-train proof
    assert {p.split("/")[0] for p in importers("hf_unlearn.trace.recorder")} <= {"replay", "replay.py", "recording.py"}
    # the public recording runs the replay engine when train() ends: nothing of the engine imports it
    assert importers("hf_unlearn.trace.recording") == []


def test_the_mixin_is_the_trainer_hooks_and_the_extension_points():
    from hf_unlearn.trace.recorder import RecordingHooks
    from hf_unlearn.trace.recording import TraceRecordingMixin

    assert {k for k, v in vars(TraceRecordingMixin).items() if callable(v) and not k.startswith("__")} \
        == {"_trace_after_train"}  # the end-of-train proof, the one thing the public mixin adds
    methods = {k for k, v in vars(RecordingHooks).items() if callable(v) and not k.startswith("__")}
    hooks = {"get_train_dataloader", "_prepare_dataset", "_remove_unused_columns", "train", "get_batch_samples",
             "training_step", "_finalize_training",
             "push_to_hub", "_push_from_checkpoint"}  # the Trainer's Hub uploads: never the trace inside output_dir
    extension_points = {"trace_preflight", "_trace_check_parallelism", "_trace_served", "_trace_row_lengths",
                        "_trace_row_length", "_trace_dummy_row", "_trace_dummy_has_weight", "_trace_replay_arguments",
                        "_trace_changed_during_training", "_trace_header_dict", "_check_dummy_has_no_influence",
                        "_trace_dummies_only_run", "_trace_masked_row",
                        "_trace_after_train", "_trace_start_weights"}
    assert methods == hooks | extension_points
