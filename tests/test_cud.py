"""CUD (hf_unlearn.analysis.cud): anchors from real unlearning runs, the score, stratified forget sets, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hf_unlearn.analysis.circuits import CircuitConfig, CircuitSet, GraphSpec, compute_circuits
from hf_unlearn.analysis.cud import (
    AnchorConfig,
    AnchorSet,
    CUDResult,
    build_anchors,
    compute_cud,
    cud_correlation,
    cud_score,
    select_anchors,
    stratify,
    write_sets,
)
from hf_unlearn.cli import main
from hf_unlearn.data.ids import read_ids
from hf_unlearn.errors import UnlearnError

from .conftest import TOFU_DIR
from .methods_helpers import memorised_model, tiny_data

# ------------------------------------------------------------------------------------------------ the score


def test_cud_score_formula_and_range():
    assert cud_score(1.0, 0.2) == 0.0  # identical to the easy anchors
    assert cud_score(0.2, 1.0) == 1.0  # identical to the hard anchors
    assert cud_score(0.6, 0.6) == 0.5 and cud_score(1.0, 1.0) == 0.5
    assert cud_score(0.5, 0.8) == pytest.approx(0.5 / (0.5 + 0.2))
    rng = np.random.default_rng(0)
    assert all(0 <= cud_score(a, b) <= 1 for a, b in rng.uniform(-1, 1, size=(200, 2)))
    assert np.isnan(cud_score(float("nan"), 0.3))


def test_select_anchors_by_majority_vote():
    ids = ["a", "b", "c", "d", "e", "f"]
    post = {"m1": [5.0, 4.0, 3.0, 2.0, 1.0, 0.5],  # a, b forgotten most
            "m2": [4.0, 5.0, 1.0, 3.0, 0.1, 0.2],
            "m3": [0.1, 5.0, 4.0, 3.0, 0.2, 0.3]}  # a is kept by m3 only: still forgotten by most (2 of 3)
    easy, hard = select_anchors(ids, post, fraction=1 / 3)
    assert easy == ["b", "a"] and hard == ["e", "f"]  # hardest first (lowest mean rank)
    assert not set(easy) & set(hard)
    # 'increase' ranks by post - pre: a sample that started high is no longer "forgotten"
    pre = [5.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    easy_inc, _ = select_anchors(ids, post, pre, fraction=1 / 3, criterion="increase")
    assert "a" not in easy_inc
    with pytest.raises(UnlearnError, match="pre-unlearning"):
        select_anchors(ids, post, criterion="increase")
    with pytest.raises(UnlearnError, match="finite"):
        select_anchors(ids, {"m": [1.0] * 5})
    with pytest.raises(UnlearnError, match="do not separate"):  # two methods that disagree completely
        select_anchors(["a", "b"], {"m1": [1.0, 2.0], "m2": [2.0, 1.0]})


def _fake_set(scores, ids, fingerprint="m", tok="t", top=2):
    g = GraphSpec("llama", n_layers=1, n_heads=1, n_kv_heads=1)  # 8 edges
    s = torch.zeros(len(ids), g.num_edges)
    for row, edges in enumerate(scores):
        for e, v in edges.items():
            s[row, g.edge_index(e)] = v
    return CircuitSet(graph=g, ids=list(ids), scores=s, clean_loss=[0.1] * len(ids), baseline_loss=[1.0] * len(ids),
                      config=CircuitConfig(top_edges=top), model_fingerprint=fingerprint, tokenizer_fingerprint=tok)


def _fake_anchors(ids, easy, hard, fingerprint="m", tok="t"):
    post = {"m1": [3.0 if i in easy else 0.1 if i in hard else 1.0 for i in ids]}
    return AnchorSet(ids=list(ids), pre_loss=[0.1] * len(ids), post_loss=post, easy=list(easy), hard=list(hard),
                     criterion="loss", fraction=0.25, model_fingerprint=fingerprint, tokenizer_fingerprint=tok)


EASY_PATH = {"input->m0": -3.0, "m0->logits": -2.0}  # a short MLP path
HARD_PATH = {"input->a0.kv0<v>": -3.0, "a0.h0->logits": -2.0}  # through the attention head


def test_cud_is_zero_on_easy_like_and_one_on_hard_like_circuits():
    ids = [1, 2, 3, 4, 5, 6]
    cs = _fake_set([EASY_PATH, EASY_PATH, HARD_PATH, HARD_PATH, EASY_PATH, HARD_PATH], ids)
    anchors = _fake_anchors(ids, easy=[1, 2], hard=[3, 4])
    for sim in ("cosine", "jaccard", "hamming"):
        for agg in ("circuit", "mean"):
            res = compute_cud(cs, anchors, similarity=sim, aggregate=agg).by_id()
            assert res[5]["cud"] == 0.0 and res[6]["cud"] == 1.0, (sim, agg)
            assert res[1]["anchor"] == "easy" and res[1]["cud"] == 0.0  # leave-one-out: anchor 2 alone still matches
            assert res[5]["anchor"] is None


def test_hamming_and_cosine_give_the_same_cud_on_equal_size_circuits():
    """For binary circuits of n edges each, 1 - cosine = (n - shared)/n and 1 - Hamming = 2 (n - shared)/E: CUD's ratio
    cancels the scale (documented in the README), for both aggregations, while Jaccard differs."""
    g = GraphSpec("llama", n_layers=1, n_heads=1, n_kv_heads=1)
    rng = np.random.default_rng(0)
    ids = list(range(10))
    cs = _fake_set([dict(zip(g.edge_names(), -rng.random(g.num_edges))) for _ in ids], ids, top=3)
    assert {len(c.edges) for c in cs.circuits} == {3}
    anchors = _fake_anchors(ids, easy=[0, 1, 2], hard=[3, 4, 5])
    for agg in ("circuit", "mean"):
        cud = {sim: [r["cud"] for r in compute_cud(cs, anchors, similarity=sim, aggregate=agg).rows]
               for sim in ("cosine", "hamming", "jaccard")}
        assert cud["hamming"] == pytest.approx(cud["cosine"], abs=1e-9)
        assert len(set(cud["cosine"])) > 2
    assert cud["jaccard"] != pytest.approx(cud["cosine"])


def test_anchor_samples_are_scored_without_themselves():
    ids = [1, 2, 3, 4]
    mixed = {**EASY_PATH, "a0.h0->logits": -2.5}  # one edge of each path
    cs = _fake_set([EASY_PATH, HARD_PATH, HARD_PATH, mixed], ids)
    res = compute_cud(cs, _fake_anchors(ids, easy=[1], hard=[2, 3])).by_id()
    assert res[1]["cud"] is None or np.isnan(res[1]["cud"])  # a one-sample group has nobody left to compare with
    assert res[2]["cud"] == 1.0  # scored against anchor 3 only
    assert res[4]["cud"] == 0.5


def test_anchors_from_another_model_or_tokenizer_are_refused():
    ids = [1, 2, 3, 4]
    cs = _fake_set([EASY_PATH, EASY_PATH, HARD_PATH, HARD_PATH], ids)
    with pytest.raises(UnlearnError, match="another model"):
        compute_cud(cs, _fake_anchors(ids, [1], [3], fingerprint="other"))
    with pytest.raises(UnlearnError, match="another tokenizer"):
        compute_cud(cs, _fake_anchors(ids, [1], [3], tok="other"))
    more = [1, 2, 3, 4, 9]
    with pytest.raises(UnlearnError, match="have no circuit"):
        compute_cud(cs, AnchorSet(ids=more, pre_loss=[0.0] * 5, post_loss={"m": [0.0] * 5}, easy=[9], hard=[3],
                                  criterion="loss", fraction=0.2, model_fingerprint="m", tokenizer_fingerprint="t"))
    with pytest.raises(UnlearnError, match="both"):
        _fake_anchors(ids, [1, 3], [3])


def test_anchor_and_cud_files_round_trip_and_refuse_tampering(tmp_path):
    ids = [1, 2, 3, 4, 5, 6]
    anchors = _fake_anchors(ids, [1, 2], [3, 4])
    back = AnchorSet.load(anchors.save(tmp_path / "anchors"))
    assert back == anchors and read_ids(tmp_path / "anchors" / "easy.jsonl") == [1, 2]
    data = json.loads((tmp_path / "anchors" / "anchors.json").read_text())
    (tmp_path / "edited.json").write_text(json.dumps({**data, "hard": [3, 77]}))  # smuggle an id never scored
    with pytest.raises(UnlearnError, match="77"):
        AnchorSet.load(tmp_path / "edited.json")
    (tmp_path / "bad.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(UnlearnError, match="not an hf_unlearn anchor"):
        AnchorSet.load(tmp_path / "bad.json")
    res = compute_cud(_fake_set([EASY_PATH] * 3 + [HARD_PATH] * 3, ids), anchors)
    path = res.to_jsonl(tmp_path / "cud.jsonl")
    again = CUDResult.from_jsonl(path)
    assert [r["id"] for r in again.rows] == ids and again.meta["similarity"] == "cosine"
    lines = path.read_text().splitlines()
    for bad, why in ((lines + [lines[0]], "twice"),
                     ([json.dumps({**json.loads(lines[0]), "cud": 1.5})], r"\[0, 1\]"),
                     (["{not json"], "not JSON"), ([json.dumps({"id": 1})], "not a CUD row")):
        (tmp_path / "t.jsonl").write_text("\n".join(bad) + "\n")
        with pytest.raises(UnlearnError, match=why):
            CUDResult.from_jsonl(tmp_path / "t.jsonl")
    (tmp_path / "cud.meta.json").write_text("{truncated")
    with pytest.raises(UnlearnError, match="cud.meta.json is not valid JSON"):
        CUDResult.from_jsonl(path)
    (tmp_path / "anchors" / "anchors.json").write_text("{truncated")
    with pytest.raises(UnlearnError, match="anchors.json is not valid JSON"):
        AnchorSet.load(tmp_path / "anchors")


def test_correlation_leaves_anchors_out():
    ids = list(range(8))
    res = compute_cud(_fake_set([EASY_PATH] * 4 + [HARD_PATH] * 4, ids), _fake_anchors(ids, [0, 1], [6, 7]))
    losses = {i: 5.0 - i for i in ids}
    corr = cud_correlation(res, losses)
    assert corr["n"] == 4 and corr["spearman"] < 0  # CUD up, loss after unlearning down
    assert cud_correlation(res, losses, include_anchors=True)["n"] == 8


# ------------------------------------------------------------------------------------------------ stratified sets


def test_stratify_writes_typed_id_files_usable_as_forget_sets(tmp_path):
    ids = [f"q-{i}" for i in range(10)] + ["3600"]  # string ids, one of them digit-only: must stay a string
    rows = [{"id": i, "cud": k / 10, "anchor": "easy" if k == 0 else "hard" if k == 9 else None,
             "stats": {"mean_edge_depth": k / 10}} for k, i in enumerate(ids)]
    res = CUDResult(rows=rows)
    sets = stratify(res, 3, seed=0)
    assert sets["easy"] == ["q-1", "q-2", "q-3"] and sets["hard"] == ["3600", "q-8", "q-7"]
    assert "q-0" not in sum(sets.values(), []) and "q-9" not in sum(sets.values(), [])
    assert sets["random"] == stratify(res, 3, seed=0)["random"] != stratify(res, 3, seed=5)["random"]
    assert len(stratify(res, 3, include_anchors=True)["easy"]) == 3 and stratify(res, 3, include_anchors=True)[
        "easy"][0] == "q-0"
    with pytest.raises(UnlearnError, match="besides the anchors"):
        stratify(res, 5)
    out = write_sets(tmp_path / "sets", sets, res, {"size": 3})
    assert read_ids(out / "hard.jsonl") == ["3600", "q-8", "q-7"]  # "3600" is read back as a string
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sets"]["easy"]["cud_max"] == pytest.approx(0.3)
    # the files select forget rows for any trainer
    from hf_unlearn import GradAscentConfig, GradAscentTrainer

    tok, forget, _ = tiny_data()
    write_sets(tmp_path / "sets2", {"hard": forget["id"][:2]})
    wanted = set(read_ids(tmp_path / "sets2" / "hard.jsonl"))
    subset = forget.filter(lambda r: r["id"] in wanted)
    trainer = GradAscentTrainer(model=memorised_model(), args=GradAscentConfig(
        output_dir=str(tmp_path / "ga"), max_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, retain_loss="none"), forget_dataset=subset, processing_class=tok)
    trainer.train()
    assert sorted(trainer.forget_ids) == sorted(wanted)


# ------------------------------------------------------------------------------------------------ real runs


def test_build_anchors_with_registered_methods_and_a_custom_one():
    """Anchors come from real runs of the library's trainers, found through the registry (a method registered by
    the user works too); every sample gets a loss after every run; the fingerprints name the model and tokenizer."""
    from hf_unlearn.analysis.circuits import model_fingerprint
    from hf_unlearn.eval.runner import tokenizer_fingerprint
    from hf_unlearn.methods.registry import METHODS, MethodSpec, register_method

    tok, forget, retain = tiny_data()
    model = memorised_model()
    register_method(MethodSpec("test_ascent", "test alias", "hf_unlearn.methods.baselines:GradAscentTrainer",
                               "hf_unlearn.methods.baselines:GradAscentConfig"))
    try:
        config = AnchorConfig(methods=["grad_diff", "test_ascent"], max_steps=4, learning_rate=5e-3, batch_size=2,
                              max_length=96, fraction=0.25,
                              method_options={"test_ascent": {"retain_loss": "none"}})
        before = {k: v.clone() for k, v in model.state_dict().items()}
        anchors = build_anchors(model, tok, forget, retain, config, progress=False)
    finally:
        METHODS.pop("test_ascent", None)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # runs work on copies
    assert anchors.methods == ["grad_diff", "test_ascent"] and anchors.ids == forget["id"]
    for m in anchors.methods:
        assert anchors.runs[m]["steps"] == 4
        assert np.mean(anchors.post_loss[m]) > np.mean(anchors.pre_loss) + 0.5  # the runs really unlearned
    assert len(anchors.easy) == len(anchors.hard) == 1
    mean = anchors.mean_post_loss()
    assert mean[anchors.easy[0]] > mean[anchors.hard[0]]
    assert anchors.model_fingerprint == model_fingerprint(model)
    assert anchors.tokenizer_fingerprint == tokenizer_fingerprint(tok)
    with pytest.raises(UnlearnError, match="unknown unlearning method"):
        AnchorConfig(methods=["nope"])


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Llama with a small BPE tokenizer trained on TOFU forget01 (fast to score)."""
    from hf_unlearn.data import load_tofu
    from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer

    rows = load_tofu("forget01", TOFU_DIR)
    tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=512)
    path = tmp_path_factory.mktemp("cud-tiny")
    build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2, seed=1).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow  # the default suite's time budget (`make test-slow` runs it)
def test_cli_circuit_anchors_cud_stratify(tiny_model_dir, tmp_path, capsys):
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(f"{i}\n" for i in range(3960, 3972)))
    data = ["--forget-split", "forget01", "--tofu", str(TOFU_DIR), "--ids", str(ids)]
    circuits, anchors = tmp_path / "circuits", tmp_path / "anchors"
    assert main(["analyze", "circuit", str(tiny_model_dir), *data, "--top-edges", "8", "--ig-steps", "2",
                 "--out", str(circuits)]) == 0
    assert CircuitSet.load(circuits).ids == list(range(3960, 3972))
    assert main(["analyze", "anchors", str(tiny_model_dir), *data, "--methods", "grad_ascent@2e-2,grad_diff",
                 "--max-steps", "2", "--lr", "1e-2", "--max-retain-rows", "8", "--fraction", "0.25",
                 "--out", str(anchors)]) == 0
    assert len(read_ids(anchors / "easy.jsonl")) == 3
    assert AnchorSet.load(anchors).runs["grad_ascent"]["hyperparameters"]["learning_rate"] == 2e-2
    out = tmp_path / "cud.jsonl"
    assert main(["analyze", "cud", "--circuits", str(circuits), "--anchors", str(anchors), "--similarity", "jaccard",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Spearman(CUD" in printed and (tmp_path / "cud.png").is_file() and (tmp_path / "cud.meta.json").is_file()
    rows = CUDResult.from_jsonl(out).rows
    assert len(rows) == 12 and sum(r["anchor"] is not None for r in rows) == 6
    assert main(["analyze", "stratify", str(out), "--size", "3", "--out", str(tmp_path / "sets")]) == 0
    for name in ("easy", "hard", "random"):
        assert len(read_ids(tmp_path / "sets" / f"{name}.jsonl")) == 3
    assert (tmp_path / "sets" / "circuit_stats.png").is_file()
    # a set is a forget set for `hf-unlearn unlearn` as written
    run = ["unlearn", "grad_ascent", str(tiny_model_dir), "--forget-split", "forget01", "--tofu", str(TOFU_DIR),
           "--max-steps", "1", "--max-retain-rows", "4", "--lr", "1e-3"]
    assert main([*run, "--forget-ids", str(tmp_path / "sets" / "hard.jsonl"), "--out", str(tmp_path / "u")]) == 0
    assert json.loads((tmp_path / "u" / "unlearning.json").read_text())["extra"]["num_forget"] == 3
    capsys.readouterr()
    for bad, says in (('"3960"\n', "is str but TOFU forget01 uses int ids"), ("5\n", "are not in TOFU forget01")):
        assert main([*run, "--forget-ids", str(_write(tmp_path / "bad.jsonl", bad)), "--out", str(tmp_path / "v")]) == 1
        assert says in capsys.readouterr().err and not (tmp_path / "v").exists()
    # the same CUD computed from the model directly (circuits scored inside `cud`)
    out2 = tmp_path / "cud2.jsonl"
    assert main(["analyze", "cud", str(tiny_model_dir), *data, "--top-edges", "8", "--ig-steps", "2",
                 "--anchors", str(anchors), "--similarity", "jaccard", "--out", str(out2)]) == 0
    assert [r["cud"] for r in CUDResult.from_jsonl(out2).rows] == pytest.approx([r["cud"] for r in rows])


def test_cli_refuses_anchors_of_another_model_in_one_line(tiny_model_dir, tmp_path, capsys):
    circuits = tmp_path / "circuits"
    data = ["--forget-split", "forget01", "--tofu", str(TOFU_DIR), "--max-samples", "4"]
    assert main(["analyze", "circuit", str(tiny_model_dir), *data, "--top-edges", "4", "--ig-steps", "1",
                 "--out", str(circuits)]) == 0
    cs = CircuitSet.load(circuits)
    _fake = AnchorSet(ids=cs.ids, pre_loss=[0.0] * 4, post_loss={"m": [3.0, 2.0, 1.0, 0.0]}, easy=[cs.ids[0]],
                      hard=[cs.ids[3]], criterion="loss", fraction=0.25, model_fingerprint="0" * 64,
                      tokenizer_fingerprint=cs.tokenizer_fingerprint)
    _fake.save(tmp_path / "foreign")
    capsys.readouterr()
    assert main(["analyze", "cud", "--circuits", str(circuits), "--anchors", str(tmp_path / "foreign")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-unlearn: error: the anchors were built with another model") and "\n" not in err
    assert main(["analyze", "cud", "--anchors", str(tmp_path / "foreign")]) == 1
    assert "give MODEL" in capsys.readouterr().err
    # circuits checked against the model named on the command line (here: the same weights, one tensor changed)
    from hf_unlearn.models import load_model

    other = load_model(tiny_model_dir)
    with torch.no_grad():
        other.model.norm.weight.add_(0.01)
    other.save_pretrained(tmp_path / "other")
    (tmp_path / "other" / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    for f in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / f).exists():
            (tmp_path / "other" / f).write_bytes((tiny_model_dir / f).read_bytes())
    _fake.model_fingerprint = cs.model_fingerprint
    _fake.save(tmp_path / "own")
    assert main(["analyze", "cud", str(tmp_path / "other"), "--circuits", str(circuits), "--anchors",
                 str(tmp_path / "own"), "--out", str(tmp_path / "c.jsonl")]) == 1
    assert "computed with another model" in capsys.readouterr().err
    assert main(["analyze", "cud", str(tmp_path / "other"), *data, "--anchors", str(tmp_path / "own"),
                 "--out", str(tmp_path / "c.jsonl")]) == 1
    assert "anchors were built with another model" in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl").exists()
    assert main(["analyze", "circuit", str(tiny_model_dir), "--forget-split", "forget01", "--tofu", str(TOFU_DIR),
                 "--ids", str(_write(tmp_path / "x.jsonl", "5\n")), "--out", str(tmp_path / "c2")]) == 1
    assert "not in TOFU forget01" in capsys.readouterr().err


def test_method_list_with_learning_rates():
    from hf_unlearn.commands.analyze import parse_methods

    assert parse_methods("grad_diff@2e-5, npo") == (["grad_diff", "npo"], {"grad_diff": {"learning_rate": 2e-5}})
    with pytest.raises(UnlearnError, match="twice"):
        parse_methods("npo,npo@1e-5")
    with pytest.raises(UnlearnError, match="METHOD@LEARNING_RATE"):
        parse_methods("npo@fast")


def _write(path, text):
    path.write_text(text)
    return path


def test_circuits_of_a_real_run_differ_between_samples():
    """Sanity on real scores: different samples get different circuits (CUD has something to compare)."""
    tok, forget, _ = tiny_data()
    cs = compute_circuits(memorised_model(), tok, forget, CircuitConfig(ig_steps=2, top_edges=10), progress=False)
    edge_sets = {tuple(sorted(c.edges.tolist())) for c in cs.circuits}
    assert len(edge_sets) > 1
