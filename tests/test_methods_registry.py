"""The one method registry: every entry resolves, every CLI option is a real config field, the CLI and the docs read it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hf_unlearn.errors import UnlearnError
from hf_unlearn.methods.registry import METHODS, MethodSpec, get_method, register_method


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_resolves_and_its_options_are_config_fields(name):
    from hf_unlearn.methods.base import UnlearningConfig, UnlearningTrainer

    spec = METHODS[name]
    trainer_cls, config_cls = spec.classes()
    assert issubclass(trainer_cls, UnlearningTrainer) and issubclass(config_cls, UnlearningConfig)
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for option in spec.options:
        assert option.field in fields, f"{name}: {option.flag} names no field of {config_cls.__name__}"
        assert option.help
        assert fields[option.field].metadata.get("help"), f"{config_cls.__name__}.{option.field} has no help"
    for key in spec.preset:
        assert key in fields


def test_preset_variant_is_applied_and_cannot_be_contradicted(tmp_path):
    cfg = get_method("npo_klr").make_config(output_dir=str(tmp_path))
    assert cfg.retain_loss == "kl"
    with pytest.raises(UnlearnError, match="fixes retain_loss='kl'"):
        get_method("npo_klr").make_config(output_dir=str(tmp_path), retain_loss="ce")


def test_unknown_method_names_the_known_ones():
    with pytest.raises(UnlearnError, match="unknown unlearning method 'npoo'; choose from masc"):
        get_method("npoo")


def test_register_method_refuses_silent_replacement():
    with pytest.raises(UnlearnError, match="already registered"):
        register_method(METHODS["npo"])
    spec = MethodSpec("my_npo", "mine", METHODS["npo"].trainer, METHODS["npo"].config)
    try:
        register_method(spec)
        from hf_unlearn.cli import build_parser

        assert "my_npo" in build_parser().format_help() or build_parser().parse_args(
            ["unlearn", "my_npo", "m", "--out", "o"]).method == "my_npo"
    finally:
        METHODS.pop("my_npo")


def test_cli_offers_exactly_the_registered_methods():
    from hf_unlearn.cli import build_parser

    parser = build_parser()
    for name in METHODS:
        assert parser.parse_args(["unlearn", name, "model", "--out", "o"]).method == name


def test_docs_document_every_registered_trainer():
    page = (Path(__file__).resolve().parents[1] / "docs" / "approximate.md").read_text()
    for spec in METHODS.values():
        assert spec.trainer.rpartition(":")[2] in page, f"docs/approximate.md lacks {spec.trainer}"
