"""`python -m superoffload train`: the main job (`make demo`).

Trains a compact GPT (or, with --hf, a tiny Hugging Face causal LM) on the embedded
byte-level corpus with the offload engine: on CUDA when present, else on the CPU with the
same schedule. Shows a progress bar (loss, tokens/s, link GB/s, overlap), then a summary and
the path of an HTML report. With --json the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from superoffload.config import OffloadConfig

MiB = 1 << 20

# Per-device defaults: small enough for a few minutes on 2 CPU cores, larger on a GPU.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"model": "small", "batch": 16, "seq": 128, "lr": 2e-3, "dtype": "fp32"},
    "cuda": {"model": "medium", "batch": 32, "seq": 256, "lr": 1e-3, "dtype": "bf16"},
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a small GPT on the embedded corpus with the offload engine",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--model", choices=("tiny", "small", "medium", "gpt2"), default=None,
                   help="GPT size (default: small on CPU, medium on CUDA)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps (default 20)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip threshold; 0 disables")
    p.add_argument("--preset", choices=("auto", "tiny_cpu", "gh200", "pcie_host"), default="auto",
                   help="engine settings to start from (default: tiny_cpu on CPU, pcie_host "
                        "on CUDA); the options below override them")
    p.add_argument("--ratio", type=float, default=None,
                   help="share of the optimizer work offloaded to the CPU (paper §4.2)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="bucket size in MiB of fp32 gradient (paper §4.2)")
    p.add_argument("--speculation", choices=("on", "off", "adaptive"), default=None,
                   help="speculation-then-validation mode (paper §4.3)")
    p.add_argument("--weights", choices=("stationary", "flow", "auto"), default=None,
                   help="weight policy (paper §4.5): keep the weights on the device, stream "
                        "the blocks from the host (flow), or let the cost model choose; "
                        "default: the preset's (works with --dp/--sp too)")
    p.add_argument("--device", default="auto", help='"auto", "cpu", "cuda" or "cuda:N"')
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="model weight dtype (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches at the end")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default runs/<timestamp>, linked as runs/latest)")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")
    p.add_argument("--save-checkpoint", action="store_true",
                   help="save the engine checkpoint to <out>/checkpoint at the end")
    p.add_argument("--hf", action="store_true",
                   help="train a tiny Hugging Face GPT-2 (needs the optional transformers)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    from superoffload.distributed.launch import add_parallel_args

    add_parallel_args(p)  # --dp/--sp/--dist-backend/--dist-timeout-s (docs/distributed.md)
    p.set_defaults(func=_run)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    return device


def _out_dir(arg: Path | None) -> Path:
    if arg is not None:
        arg.mkdir(parents=True, exist_ok=True)
        return arg
    runs = Path("runs")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = runs / stamp
    n = 1
    while out.exists():
        out, n = runs / f"{stamp}-{n}", n + 1
    out.mkdir(parents=True)
    latest = runs / "latest"
    try:  # best effort: a convenience link, not needed by anything
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(out.name)
    except OSError:
        pass
    return out


def _build_model(args: argparse.Namespace, preset: str, seq: int) -> torch.nn.Module:
    if args.hf:
        from superoffload.models.hf import HF_MISSING, hf_available, tiny_hf_causal_lm

        if not hf_available():
            raise SystemExit(HF_MISSING)
        return tiny_hf_causal_lm(block_size=seq, seed=args.seed)
    from superoffload.models import GPT, PRESETS

    torch.manual_seed(args.seed)
    cfg = PRESETS[preset](checkpointing=args.checkpointing)
    if seq > cfg.block_size:
        cfg.block_size = seq
    return GPT(cfg)


def engine_config(args: argparse.Namespace, device: torch.device) -> OffloadConfig:
    """The preset for this device, with the options the user gave applied on top."""
    from superoffload import presets

    name = args.preset
    if name == "auto":
        name = "pcie_host" if device.type == "cuda" else "tiny_cpu"
    changes: dict[str, Any] = {"device": str(device), "seed": args.seed,
                               "max_grad_norm": args.max_grad_norm or None}
    if args.ratio is not None:
        changes["ratio"] = args.ratio
    if args.speculation is not None:
        changes["speculation"] = args.speculation
    if args.weights is not None:
        changes["weights"] = args.weights
    if args.bucket_mb is not None:
        changes["bucket_bytes"] = max(4096, int(args.bucket_mb * MiB))
    if device.type == "cpu":
        changes["pin_memory"] = False  # nothing to pin without a device link
    try:
        return presets.PRESETS[name]().replace(**changes)
    except ValueError as exc:
        raise SystemExit(f"invalid engine option: {exc}") from None


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups (nanoGPT, GPT-3 §C): weight decay on matrices and embeddings, none on
    biases and LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def run_training(args: argparse.Namespace) -> dict[str, Any]:
    """Build model, data and engine from parsed arguments; train; write the report.
    Returns the JSON-able result (the CLI prints it)."""
    import superoffload as so
    from superoffload.data import BatchSampler, load_tokens, split_train_val
    from superoffload.telemetry.metrics import to_records
    from superoffload.train_loop import TrainSettings, train

    dp = _start_data_parallel(args)  # None unless under torchrun (or --dp/--sp > 1)
    device = torch.device(dp.device) if dp is not None else _resolve_device(args.device)
    d = _DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    preset = args.model or d["model"]
    batch, seq, lr = args.batch or d["batch"], args.seq or d["seq"], args.lr or d["lr"]
    global_batch = batch
    if dp is not None:  # --batch is the global batch; each rank takes its share
        if batch % dp.dp:
            raise SystemExit(f"--batch={batch} must be a multiple of the data-parallel degree {dp.dp}")
        batch //= dp.dp
        args.quiet = args.quiet or dp.rank != 0
        args.no_report = args.no_report or dp.rank != 0
    dtype_name = d["dtype"] if args.dtype == "auto" else args.dtype
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    for name, value in (("--steps", args.steps), ("--batch", batch), ("--seq", seq)):
        if value < 1:
            raise SystemExit(f"{name}={value}: use a whole number >= 1")

    model = _build_model(args, preset, seq).to(device=device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    if dp is not None and dp.sp > 1:
        _make_sequence_parallel(model, dp.sp, seq)
    config = engine_config(args, device)
    tokens = load_tokens()
    train_tokens, val_tokens = split_train_val(tokens)
    rank_seed = args.seed + (1000 * dp.dp_rank if dp is not None else 0)  # other data per rank
    batches: Any = BatchSampler(train_tokens, batch_size=batch, seq_len=seq, seed=rank_seed)
    val: Any = BatchSampler(val_tokens, batch_size=batch, seq_len=seq, seed=args.seed + 1)
    if dp is not None and dp.sp > 1:  # every rank of an sp group: the same sequences, its slice
        batches, val = SequenceShard(batches), SequenceShard(val)
    out = _out_dir(args.out) if dp is None or dp.rank == 0 else Path()
    if dp is not None:
        out = _shared_out_dir(out)
    label = "HF GPT-2 (tiny)" if args.hf else f"GPT {preset}"
    info = {"model": label, "params": n_params, "device": str(device), "dtype": dtype_name,
            "batch": global_batch, "seq": seq, "lr": lr, "steps": args.steps,
            "preset": args.preset, "bucket_bytes": config.bucket_bytes, "ratio": config.ratio,
            "grad_cast": config.grad_cast, "param_cast": config.param_cast,
            "cpu_threads": config.cpu_threads,
            "speculation": config.speculation, "max_grad_norm": config.max_grad_norm,
            "weights": config.weights,
            "torch_threads": torch.get_num_threads(), "dp": dp.dp if dp is not None else 1,
            "sp": dp.sp if dp is not None else 1, "batch_per_rank": batch,
            "seq_per_rank": seq // (dp.sp if dp is not None else 1)}
    if not args.json and not args.quiet:
        print(f"training {label}: {n_params / 1e6:.2f} M params on {device} ({dtype_name}), "
              f"batch {batch} x {seq} tokens, {args.steps} steps; output in {out}", flush=True)

    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="train", unit="step", file=sys.stderr,
                   dynamic_ncols=True, mininterval=0.5)

    def on_step(s: Any) -> None:
        if bar is not None:
            bar.update(1)
            overlap = "-" if s.overlap != s.overlap else f"{s.overlap:.0%}"
            bar.set_postfix_str(f"loss {s.loss:.3f} | {s.tokens_per_s:,.0f} tok/s | "
                                f"link {s.link_gbps:.2f} GB/s | overlap {overlap}", refresh=False)

    settings = TrainSettings(steps=args.steps, warmup_steps=min(args.warmup, args.steps),
                             eval_batches=args.eval_batches)
    groups = param_groups(model, args.weight_decay)
    for g in groups:
        g.update(lr=lr, betas=(0.9, 0.95))
    engine_ctx: Any
    if dp is not None:
        from superoffload.distributed.zero import ZeroOffloadEngine

        # over the dp group when sp == 1, over all dp*sp ranks with sequence parallel
        engine_ctx = ZeroOffloadEngine(model, groups, config)
    else:
        engine_ctx = so.initialize(model, optimizer=groups, config=config)
    with engine_ctx as engine:
        try:
            result = train(engine, model, batches, settings, val_batches=val, on_step=on_step,
                           loss_reduce=_global_mean if dp is not None else None)
        finally:
            if bar is not None:
                bar.close()
        if args.save_checkpoint:
            engine.save_checkpoint(str(out / "checkpoint"),
                                   extra={"train_sampler": batches.state_dict()})
        stats = {k: getattr(engine.stats, k) for k in
                 ("iterations", "skipped_steps", "clipped_steps", "rollbacks", "replays")}
        recorder = engine.telemetry
        spans = result.spans
        if dp is not None:  # rank 0's report shows every rank's lanes (issue 7)
            spans = _gather_rank_spans(spans, recorder)
        report_path = None
        if not args.no_report:
            from superoffload.telemetry.report import write_html_report

            extra = {**info, "first_loss": result.first_loss, "final_loss": result.final_loss,
                     "val_loss": result.val_loss, "tokens_per_s": round(result.tokens_per_s),
                     **stats}
            scalars: dict[str, list[tuple[int, float]]] = {}
            for sc in recorder.scalars():
                scalars.setdefault(sc.name, []).append((sc.iteration, sc.value))
            scalars["lr"] = list(enumerate(result.lrs))
            report_path = write_html_report(spans, out / "report.html",
                                            title=f"superoffload train: {label} on {device}",
                                            extra=extra, scalars=scalars,
                                            notes=[f"iteration {n.iteration}: {n.text}"
                                                   for n in recorder.notes()])
        records = to_records(result.spans)
        if dp is not None and dp.sp > 1:
            from superoffload.distributed import remove_ulysses

            remove_ulysses(model)  # type: ignore[arg-type]  # a GPT (checked); generate() runs the whole sequence on one rank
        sample = None if args.hf else _sample(model, device)
    payload: dict[str, Any] = {
        **result.to_dict(), **info, "engine_stats": stats,
        "report": str(report_path) if report_path else None, "out": str(out), "sample": sample,
    }
    if dp is not None:  # every rank trains on its own tokens: the job's rate is their sum
        world = dp.dp * dp.sp
        payload["tokens_per_s_per_rank"] = payload["tokens_per_s"]
        payload["tokens"] = payload["tokens"] * world
        payload["tokens_per_s"] = payload["tokens_per_s"] * world
    if dp is None or dp.rank == 0:
        (out / "result.json").write_text(json.dumps({**payload, "iterations": records}, indent=1))
    if dp is not None:
        from superoffload.distributed import shutdown

        payload["rank"] = dp.rank
        shutdown()
    return payload


# ---- data parallel under torchrun: a delimited extension (issue 7; docs/distributed.md)
def _gather_rank_spans(spans: list[Any], recorder: Any) -> list[Any]:
    """Every rank's spans on rank 0, on rank 0's clock (other ranks get their own back).

    A collective: every rank calls it. Clocks are aligned by the recorders' perf_counter
    origins, which is exact for ranks on one host (perf_counter is system-wide there)."""
    import torch.distributed as dist

    from superoffload.telemetry.ranks import merge_rank_spans

    mine = (dist.get_rank(), recorder.origin_perf_counter_s, spans)
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return spans
    origin0 = recorder.origin_perf_counter_s
    return merge_rank_spans([g[2] for g in gathered], ranks=[g[0] for g in gathered],
                            offsets_s=[g[1] - origin0 for g in gathered])


def _start_data_parallel(args: argparse.Namespace) -> Any:
    """init_distributed() when launched by torchrun or asked for --dp/--sp > 1; else None."""
    if "WORLD_SIZE" not in os.environ and (args.dp or 1) == 1 and args.sp == 1:
        return None
    from superoffload.distributed import init_from_args

    if args.sp > 1 and args.hf:
        raise SystemExit("train --sp > 1 --hf: sequence parallel is wired for our GPT only; "
                         "drop --hf (Hugging Face models: docs/distributed.md)")
    try:
        return init_from_args(args)
    except ValueError as exc:  # --dp x --sp not matching the launched processes
        raise SystemExit(f"train: {exc}") from None


def _make_sequence_parallel(model: torch.nn.Module, sp: int, seq: int) -> None:
    """Ulysses attention over this rank's sp group (docs/distributed.md, "dp x sp")."""
    from superoffload.distributed import apply_ulysses, get_groups
    from superoffload.models import GPT

    if seq % sp:
        raise SystemExit(f"--seq={seq} is not divisible by --sp={sp}: use a multiple of {sp}")
    if not isinstance(model, GPT):
        raise SystemExit("train --sp > 1: sequence parallel is wired for our GPT only")
    try:
        apply_ulysses(model, get_groups().sp_group)
    except ValueError as exc:  # heads not divisible by sp
        raise SystemExit(f"train --sp {sp}: {exc}") from None


class SequenceShard:
    """A batch sampler yielding this rank's contiguous 1/sp slice of every sequence (targets
    are already shifted by the sampler, so no target lies on another rank)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        from superoffload.distributed import get_groups, split_sequence

        x, y = self.inner.next_batch()
        sp_group = get_groups().sp_group
        return split_sequence(x, sp_group), split_sequence(y, sp_group)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.inner.state_dict())


def _global_mean(loss: Any) -> Any:
    """The mean loss over every rank (equal token counts: the global-batch mean)."""
    from superoffload.distributed import get_groups, mean_over_group

    return mean_over_group(loss, get_groups().world_group)


def _shared_out_dir(out: Path) -> Path:
    """Rank 0's output folder, told to every rank (the sharded checkpoint goes there)."""
    import torch.distributed as dist

    box: list[Any] = [str(out)]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _sample(model: torch.nn.Module, device: torch.device, prompt: str = "def ",
            new_bytes: int = 120) -> str:
    """Greedy continuation of `prompt`: a look at what the model learned."""
    from superoffload.data import decode, encode

    idx = encode(prompt).long().to(device)[None, :]
    model.eval()
    out = model.generate(idx, new_bytes, temperature=0.0)  # type: ignore[operator]
    return decode(out[0].cpu())


def _print_summary(r: dict[str, Any]) -> None:
    s = r.get("summary") or {}
    print(f"loss {r['first_loss']:.3f} -> {r['final_loss']:.3f} (mean of the last steps)"
          + (f", held-out {r['val_loss']:.3f}" if r.get("val_loss") is not None else ""))
    print(f"{r['tokens_per_s']:,.0f} tokens/s over {r['steps']} steps ({r['elapsed_s']:.1f} s)")
    if s:
        print(f"per iteration (median): {s['wall_s'] * 1e3:.1f} ms, device idle "
              f"{s['device_idle_frac']:.0%}, CPU optimizer overlapped {s['cpu_overlap_frac']:.0%}, "
              f"exposed optimizer {s['exposed_optimizer_s'] * 1e3:.1f} ms, link "
              f"{(s['d2h_gbps_wall'] + s['h2d_gbps_wall']):.2f} GB/s")
    st = r["engine_stats"]
    print(f"engine: {st['clipped_steps']} clipped steps, {st['rollbacks']} bucket rollbacks, "
          f"{st['replays']} replays, {st['skipped_steps']} skipped")
    if r.get("sample"):
        print("sample (greedy): " + repr(r["sample"]))
    if r.get("report"):
        print(f"report: {os.path.abspath(r['report'])}")


def _run(args: argparse.Namespace) -> int:
    result = run_training(args)
    if result.get("rank", 0) != 0:
        return 0  # rank 0 speaks for the data-parallel job
    if not args.quiet or not args.json:
        _print_summary(result)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0
