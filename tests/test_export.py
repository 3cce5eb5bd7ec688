"""`superoffload.export_hf` from a live engine and from `engine.save_checkpoint` folders
(docs/export.md).

The reference is the engine's own fp32 masters (`engine.master_weights()`): an fp32 export
must equal them bit for bit, a bf16 export must equal `master.to(torch.bfloat16)` bit for
bit (rounded once, to nearest even), and neither may read the model's bf16 weights, which
differ from the masters here by up to ~4e-3 (checked, so a test that read them would fail).
Files are read back with the `safetensors` package itself, not with our reader.

The model: tests/_tiny_models.TinyGPT in bf16 (tied head, a frozen layer, unequal layers so
buckets split unevenly) plus an int64 and a float buffer; ratio 0.5, so masters live both in
GPU-tail buckets and in host buckets.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _engine_ref import HYPER, cpu_config, groups_for
from _tiny_models import TinyGPT, batches

import superoffload as so
from superoffload.export import NotACheckpoint, export_hf
from superoffload.export.shards import parse_size, plan_shards
from superoffload.export.source import plan_entries
from superoffload.runtime.ckpt_files import CheckpointCorrupt, write_atomic

safetensors_torch = pytest.importorskip("safetensors.torch", reason="reads exports back")

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
TIED = ("head.weight", "wte.weight")  # (alias, the parameter's name)


class WithBuffers(TinyGPT):
    def __init__(self) -> None:
        super().__init__(frozen=True)
        self.register_buffer("position_ids", torch.arange(16))
        self.register_buffer("scale", torch.full((5,), 0.3))


def make_engine() -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = WithBuffers().to(torch.bfloat16)
    engine = so.initialize(model, groups_for(model, True, HYPER), cpu_config(ratio=0.5))
    for x, y in batches(3):
        engine.backward(model(x, y))
        engine.step()
        engine.zero_grad()
    return model, engine


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch.set_num_threads(1)
    model, engine = make_engine()
    masters = engine.master_weights()
    ckpt = tmp_path_factory.mktemp("export") / "ckpt"
    engine.save_checkpoint(str(ckpt))
    yield model, engine, masters, ckpt
    engine.close()


def read_folder(folder: Path, stem: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor of an exported folder, read with the safetensors package."""
    index = folder / f"{stem}.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else [f"{stem}.safetensors"])
    out: dict[str, torch.Tensor] = {}
    for name in files:
        part = safetensors_torch.load_file(str(folder / name))
        assert not set(part) & set(out), "a tensor in two files"
        out.update(part)
    return out


def expected(model: torch.nn.Module, masters: dict[str, torch.Tensor],
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What the folder must hold: every state-dict key but the tied alias; masters for the
    trained parameters; every floating tensor in `dtype`, integer ones as they are."""
    sd = model.state_dict()
    out = {}
    for k, v in sd.items():
        if k == TIED[0]:
            continue
        v = masters.get(k, v)
        out[k] = v.to(dtype) if v.is_floating_point() else v
    return out


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].view(-1).view(torch.uint8), want[k].view(-1).view(torch.uint8)), k


def test_the_models_bf16_weights_are_not_the_masters(trained: Any) -> None:
    # the control: a test reading the model's weights instead of the masters would fail
    model, _, masters, _ = trained
    diff = (model.wte.weight.float() - masters["wte.weight"]).abs().max()
    assert 1e-5 < diff < 1e-2  # measured ~4e-3 (bf16's half-ulp at |w| ~ 0.5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_live_export_is_the_masters_bit_for_bit(trained: Any, tmp_path: Path, dtype: str) -> None:
    model, engine, masters, _ = trained
    report = export_hf(engine, tmp_path / "out", dtype=dtype)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert_bit_equal(read_folder(tmp_path / "out"), expected(model, masters, torch_dtype))
    assert report.files == ("model.safetensors",) and report.index_file is None
    assert report.config_from is None and not (tmp_path / "out" / "config.json").exists()
    # the tied weight is written once, under the parameter's name, from its master
    got = read_folder(tmp_path / "out")
    assert TIED[0] not in got and torch.equal(got[TIED[1]], masters[TIED[1]].to(torch_dtype))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_checkpoint_export_is_the_saved_masters(trained: Any, tmp_path: Path,
                                                       dtype: str) -> None:
    model, _, masters, ckpt = trained
    report = export_hf(ckpt, tmp_path / "out", dtype=dtype)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert_bit_equal(read_folder(tmp_path / "out"), expected(model, masters, torch_dtype))
    assert report.source == f"engine checkpoint {ckpt}"


def test_a_new_checkpoint_saves_a_tied_weight_once(trained: Any) -> None:
    _, _, _, ckpt = trained
    payload = torch.load(ckpt / "engine.pt", weights_only=True, mmap=True)
    head, wte = (payload["model"][k] for k in TIED)
    assert head.untyped_storage().data_ptr() == wte.untyped_storage().data_ptr()


def test_an_older_checkpoint_with_a_copied_tied_weight_exports_it_once(
        trained: Any, tmp_path: Path) -> None:
    """Checkpoints written before tied weights were saved once hold the head as a separate
    bf16 copy; the export still writes the embedding once, from its master (the copy is
    recognised by its bytes), and our loader ties it again."""
    model, _, masters, ckpt = trained
    payload = torch.load(ckpt / "engine.pt", weights_only=True)
    payload.pop("integrity")
    payload["model"] = {k: v.clone() for k, v in payload["model"].items()}  # no sharing left
    old = tmp_path / "old"
    old.mkdir()
    write_atomic(payload, str(old / "engine.pt"))  # sealed; no meta.json: the seal decides
    export_hf(old, tmp_path / "out")
    assert_bit_equal(read_folder(tmp_path / "out"), expected(model, masters, torch.float32))


def test_shards_hold_at_most_the_bound_and_the_index_names_every_tensor(
        trained: Any, tmp_path: Path) -> None:
    model, engine, masters, _ = trained
    bound = 6000  # bytes: several tensors per file, and tensors larger than the bound
    report = export_hf(engine, tmp_path / "out", max_shard_bytes=bound)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    n = len(report.files)
    assert n > 3 and report.files == tuple(f"model-{k:05d}-of-{n:05d}.safetensors"
                                           for k in range(1, n + 1))
    assert sorted(p.name for p in out.iterdir()) == sorted([*report.files,
                                                            "model.safetensors.index.json"])
    want = expected(model, masters, torch.float32)
    assert sorted(index["weight_map"]) == sorted(want)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size()
                                                  for v in want.values())
    for name in report.files:
        part = safetensors_torch.load_file(str(out / name))
        nbytes = sum(v.numel() * v.element_size() for v in part.values())
        assert nbytes <= bound or len(part) == 1, (name, nbytes)
        assert all(index["weight_map"][k] == name for k in part)
    assert_bit_equal(read_folder(out), want)


class Spy:
    """A source that counts the bytes of the tensors it handed out and that are still alive
    (weakrefs): how much the writer holds at once, whatever it does with them."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.alive, self.peak = inner, 0, 0
        self.what, self.stem, self.single_file = inner.what, inner.stem, inner.single_file

    def _track(self, t: torch.Tensor) -> torch.Tensor:
        import weakref

        nbytes = t.numel() * t.element_size()
        self.alive += nbytes
        self.peak = max(self.peak, self.alive)
        weakref.finalize(t, self._gone, nbytes)
        return t

    def _gone(self, nbytes: int) -> None:
        self.alive -= nbytes

    def entries(self) -> Any:
        return self.inner.entries()

    def read_master(self, name: str) -> torch.Tensor:
        return self._track(self.inner.read_master(name))

    def read_other(self, name: str) -> torch.Tensor:
        return self._track(self.inner.read_other(name))

    def extras(self) -> Any:
        return self.inner.extras()

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_writer_holds_one_tensor_at_a_time(trained: Any, tmp_path: Path,
                                               dtype: str) -> None:
    from superoffload.export.detect import open_source

    _, _, _, ckpt = trained
    spy = Spy(open_source(str(ckpt)))
    sizes = [torch.Size(e.shape).numel() * 4 for e in spy.entries()]  # as read: fp32
    bound = 3 * max(sizes)  # each file holds several tensors
    report = export_hf(spy, tmp_path / "out", dtype=dtype, max_shard_bytes=bound)
    assert len(report.files) > 1
    assert spy.peak == max(sizes)  # never two tensors from the source at once
    cast = max(sizes) // 2 if dtype == "bf16" else 0  # its bf16 copy, while it is made
    assert report.peak_held_bytes == max(sizes) + cast < bound


def test_plan_entries_reads_a_tied_group_from_the_key_holding_the_master() -> None:
    # a group of aliases whose master is not its first key: still one entry, from the master
    entries = plan_entries([["head.weight", "wte.weight"], ["scale"]], lambda k: (2, 3),
                           lambda k: torch.bfloat16, {"wte.weight": None})
    assert [(e.key, e.master, e.dtype) for e in entries] == [
        ("wte.weight", True, torch.float32), ("scale", False, torch.bfloat16)]


# ---------------------------------------------------------------- pure shard planning
@pytest.mark.parametrize(("text", "nbytes"), [
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("1.5KB", 1500),
    ("4096", 4096), (4096, 4096), ("3 mib", 3 * 2**20)])
def test_sizes_read_as_hugging_face_reads_them(text: Any, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["5 parsecs", "GB", "-1GB", "0", ""])
def test_a_size_that_is_not_one_is_refused_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="max shard size"):
        parse_size(text)


def test_a_file_filled_exactly_to_the_bound_stays_one_file() -> None:
    plan = plan_shards([("a", 40), ("b", 60), ("c", 1)], 100)
    assert [s.keys for s in plan.shards] == [("a", "b"), ("c",)]
    plan = plan_shards([("a", 40), ("big", 300), ("c", 10)], 100)
    assert [s.keys for s in plan.shards] == [("a",), ("big",), ("c",)]  # too big: alone
    assert plan.index()["metadata"] == {"total_size": 350}
    single = plan_shards([("a", 40), ("b", 60)], 100)
    assert [s.file for s in single.shards] == ["model.safetensors"] and single.index_file is None


# ---------------------------------------------------------------- our GPT, and train runs
def test_our_gpt_round_trips_through_load_gpt(tmp_path: Path) -> None:
    from superoffload.export import load_gpt
    from superoffload.models import GPT, gpt_tiny

    torch.manual_seed(0)
    model = GPT(gpt_tiny()).to(torch.bfloat16)
    with so.initialize(model, {"lr": 1e-2}, cpu_config()) as engine:
        idx = torch.randint(0, 256, (2, 16))
        engine.backward(model(idx, idx))
        engine.step()
        masters = engine.master_weights()
        report = export_hf(engine, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "superoffload-gpt" and config["dtype"] == "float32"
    assert report.config_from == "the model's GPTConfig"
    loaded = load_gpt(str(tmp_path / "out"))
    assert loaded.lm_head.weight is loaded.wte.weight  # tied again
    got = dict(loaded.named_parameters())
    assert sorted(got) == sorted(masters)
    assert all(torch.equal(got[k].detach(), masters[k]) for k in masters)


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two real `train` runs (our GPT, and --hf), bf16, a final checkpoint each."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("runs")
    for name, extra in (("gpt", ["--model", "tiny"]), ("hf", ["--hf"])):
        done = subprocess.run(
            [sys.executable, "-m", "superoffload", "train", *extra, "--batch", "2", "--seq",
             "32", "--steps", "2", "--eval-batches", "1", "--device", "cpu", "--dtype", "bf16",
             "--quiet", "--json", "--no-report", "--save-checkpoint", "--out", str(out / name)],
            capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    return out


def _saved_masters(ckpt: Path) -> dict[str, torch.Tensor]:
    payload = torch.load(ckpt / "engine.pt", weights_only=True)
    return {k: s["master"] for k, s in payload["state"].items()}


def test_a_train_run_exports_with_the_config_it_was_built_from(train_runs: Path,
                                                               tmp_path: Path) -> None:
    from superoffload.export import load_gpt

    ckpt = train_runs / "gpt" / "checkpoint"
    report = export_hf(ckpt, tmp_path / "gpt")
    assert report.config_from == f"{ckpt / 'train.json'} (the model the run built)"
    model = load_gpt(str(tmp_path / "gpt"))
    masters = _saved_masters(ckpt)
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(masters)
    assert all(torch.equal(got[k].detach(), masters[k]) for k in masters)


def test_a_train_hf_run_loads_with_from_pretrained_exactly(train_runs: Path,
                                                           tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ckpt = train_runs / "hf" / "checkpoint"
    export_hf(ckpt, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    masters = _saved_masters(ckpt)  # named "hf.<key>": the adapter's prefix is dropped
    sd = model.state_dict()
    assert all(k.startswith("hf.") for k in masters)
    assert all(torch.equal(sd[k.removeprefix("hf.")], v) for k, v in masters.items())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.dtype == torch.float32


def test_the_cli_exports_and_reports(train_runs: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from superoffload.cli import main

    ckpt = train_runs / "gpt" / "checkpoint"
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--dtype", "bf16",
                 "--max-shard-size", "100KB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "bf16" and len(report["files"]) > 1
    assert report["index_file"] == "model.safetensors.index.json"
    masters = _saved_masters(ckpt)
    got = read_folder(tmp_path / "out")
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in masters.items())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"


# ---------------------------------------------------------------- every checkpoint says how
def test_a_checkpoint_says_how_to_export_it(trained: Any, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    _, engine, _, ckpt = trained
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["export"].startswith("python -m superoffload export <this folder> <out_dir>")
    with caplog.at_level(logging.INFO, logger="superoffload.checkpoint"):
        engine.save_checkpoint(str(tmp_path / "again"))
    assert f"export it with python -m superoffload export {tmp_path / 'again'} <out_dir>" \
        in caplog.text


# ---------------------------------------------------------------- bad input
def test_a_folder_that_is_no_checkpoint_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(NotACheckpoint) as err:
        export_hf(tmp_path, tmp_path.parent / f"{tmp_path.name}-out")
    text = str(err.value)
    assert f"{tmp_path} is not a checkpoint: it holds notes.txt, weights.bin" in text
    assert "expected engine.pt (engine.save_checkpoint), manifest.json" in text
    assert "optimizer.pt + trainer_state.json" in text
    assert not (tmp_path.parent / f"{tmp_path.name}-out").exists()


def test_a_run_folder_is_refused_naming_the_checkpoints_inside(trained: Any,
                                                               tmp_path: Path) -> None:
    import shutil

    _, _, _, ckpt = trained
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "checkpoints" / "step-000004")
    shutil.copytree(ckpt, run / "checkpoint")
    with pytest.raises(NotACheckpoint, match="Checkpoints inside it: .*checkpoint, .*"
                                             "step-000004: pass one of them"):
        export_hf(run, tmp_path / "out")


def test_a_hugging_face_folder_is_refused_as_one(trained: Any, tmp_path: Path) -> None:
    _, engine, _, _ = trained
    export_hf(engine, tmp_path / "hf", config=_config_file(tmp_path))
    with pytest.raises(NotACheckpoint, match="a Hugging Face model folder already"):
        export_hf(tmp_path / "hf", tmp_path / "again")


def _config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "tiny", "torch_dtype": "bfloat16"}))
    return path


def test_config_given_gets_the_exports_dtype(trained: Any, tmp_path: Path) -> None:
    _, engine, _, _ = trained
    report = export_hf(engine, tmp_path / "out", dtype="bf16", config=_config_file(tmp_path))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    # the older key is kept where the config uses it (transformers < 5 reads only that one)
    assert config == {"model_type": "tiny", "torch_dtype": "bfloat16"}
    assert report.config_from == str(tmp_path / "config.json")


@pytest.mark.parametrize("what", ["missing", "file"])
def test_a_source_that_is_no_folder_is_refused(tmp_path: Path, what: str) -> None:
    source = tmp_path / "nothing"
    if what == "file":
        source.write_text("x")
    what = "is a file, not a folder" if what == "file" else "does not exist"
    with pytest.raises(FileNotFoundError, match=f"{source} {what} .*expected a checkpoint "
                                                "folder"):
        export_hf(source, tmp_path / "out")


def test_an_out_folder_that_holds_files_is_never_overwritten(trained: Any,
                                                             tmp_path: Path) -> None:
    _, engine, _, _ = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="exists and is not an empty folder"):
        export_hf(engine, out)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    (out / "mine.txt").unlink()
    export_hf(engine, out)  # an empty folder is fine
    assert (out / "model.safetensors").exists()


def test_a_damaged_checkpoint_is_refused_and_nothing_is_written(trained: Any,
                                                                tmp_path: Path) -> None:
    import shutil

    from _ckpt_support import flip_tensor_byte

    _, _, _, ckpt = trained
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    flip_tensor_byte(bad / "engine.pt")
    with pytest.raises(CheckpointCorrupt, match="does not match the SHA-256 its meta.json"):
        export_hf(bad, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_an_export_that_fails_midway_leaves_nothing(trained: Any, tmp_path: Path) -> None:
    from superoffload.export.detect import open_source

    _, _, _, ckpt = trained

    class Failing(Spy):
        def read_master(self, name: str) -> torch.Tensor:
            if self.peak:  # the second master
                raise OSError("disk gone")
            return super().read_master(name)

    with pytest.raises(OSError, match="disk gone"):
        export_hf(Failing(open_source(str(ckpt))), tmp_path / "out", max_shard_bytes=4000)
    assert os.listdir(tmp_path) == []


def test_a_disk_too_small_is_refused_before_writing(trained: Any, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    _, engine, _, _ = trained
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(OSError, match="no space left on device: the export needs"):
        export_hf(engine, tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_a_plain_optimizer_checkpoint_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    (tmp_path / "trainer_state.json").write_text("{}")
    with pytest.raises(ValueError, match="holds a torch.optim state dict .*written by another "
                                         "optimizer than the offload engine"):
        export_hf(tmp_path, tmp_path.parent / "out-plain")


def test_bad_options_are_refused_by_name(trained: Any, tmp_path: Path) -> None:
    _, engine, _, _ = trained
    with pytest.raises(ValueError, match="dtype='fp16': choose one of"):
        export_hf(engine, tmp_path / "out", dtype="fp16")
    with pytest.raises(ValueError, match="max shard size '5 parsecs'"):
        export_hf(engine, tmp_path / "out", max_shard_bytes="5 parsecs")
    with pytest.raises(TypeError, match="Linear is neither an offload engine"):
        export_hf(torch.nn.Linear(2, 2), tmp_path / "out")


def test_the_cli_refuses_a_folder_that_is_no_checkpoint(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from superoffload.cli import main

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "readme.md").write_text("x")
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"error: export: {tmp_path / 'src'} is not a checkpoint: it holds readme.md" in err
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "out"),
                 "--max-shard-size", "lots"]) == 2
    assert "--max-shard-size: max shard size 'lots' is not a size" in capsys.readouterr().err


def test_a_live_engine_mid_iteration_is_refused(tmp_path: Path) -> None:
    model, engine = make_engine()
    with engine:
        x, y = batches(1, seed=5)[0]
        engine.backward(model(x, y))  # backward done, step() not yet
        with pytest.raises(so.MidIterationState, match="export_hf"):
            export_hf(engine, tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_the_docs_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/export.md's first example, as written (it asserts the round trip itself)."""
    import re

    doc = (Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S)
    assert code is not None
    monkeypatch.chdir(tmp_path)
    exec(compile(code.group(1), "docs/export.md", "exec"), {})
    assert (tmp_path / "model_fp32" / "config.json").exists()
    assert (tmp_path / "model_bf16" / "model.safetensors.index.json").exists()


def test_a_former_zero_checkpoint_is_refused_with_the_way_forward(tmp_path: Path) -> None:
    fixture = Path(__file__).with_name("fixtures") / "zero_checkpoint" / "checkpoint"
    with pytest.raises(ValueError, match="former ZeRO engine .*load it with the FSDP2 engine "
                                         r"\(load_checkpoint converts it\) and save it again"):
        export_hf(fixture, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_live_data_parallel_engine_is_refused_naming_the_way(tmp_path: Path) -> None:
    from types import SimpleNamespace

    engine = SimpleNamespace(state=None, export_states=None, world_size=2)
    with pytest.raises(ValueError, match=r"\(2 ranks\): its fp32 masters are sharded .*"
                                         r"engine\.save_checkpoint\(path\) on every rank"):
        export_hf(engine, tmp_path / "out")


def test_a_weight_flow_engine_exports_its_streamed_blocks_whole(tmp_path: Path) -> None:
    """Under weight-flow the streamed parameters hold no elements between uses; the export
    takes their shapes from the engine and their values from the masters."""
    from _tiny_models import make_model

    model = make_model(dtype=torch.bfloat16, n_blocks=3)
    model.blocks[1].ln.requires_grad_(False)  # frozen: never streamed
    trained = [p for p in model.parameters() if p.requires_grad]
    with so.initialize(model, [{"params": trained, **HYPER}], cpu_config(weights="flow")) as engine:
        for x, y in batches(2):
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        released = [n for n, p in model.named_parameters() if p.numel() == 0]
        assert "blocks.0.fc1.weight" in released  # the control: streamed out now
        masters = engine.master_weights()
        export_hf(engine, tmp_path / "out")
    assert_bit_equal(read_folder(tmp_path / "out"), expected(model, masters, torch.float32))
