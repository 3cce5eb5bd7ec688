"""`python -m superoffload train`: the main job (`make demo`).

Trains a compact GPT (or, with --hf, a tiny Hugging Face causal LM) on the embedded
byte-level corpus with the offload engine: on CUDA when present, else on the CPU with the
same schedule. Shows a progress bar (loss, tokens/s, link GB/s, overlap), then a summary and
the path of an HTML report. With --json the last line printed is one JSON object.

Keeping work: --checkpoint-every N saves the run every N steps; Ctrl-C or SIGTERM stops at
the next step boundary and saves a checkpoint there; --resume DIR continues bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from superoffload.commands import checkpointing as ck
from superoffload.commands import run_budget, run_lock, train_calibration, train_dist
from superoffload.commands.checkpointing import CheckpointFailed, prepare_run_folder
from superoffload.commands.signals import StopSignals
from superoffload.commands.train_args import (
    PROG,
    RunSettings,
    UsageError,
    add_arguments,
    resolve_settings,
)
from superoffload.commands.train_build import (
    build_model,
    param_groups,
    resolve_device,
    run_config,
)
from superoffload.commands.train_output import (
    one_line,
    print_summary,
    progress_postfix,
    sample_text,
    write_report,
)
from superoffload.commands.train_preflight import check_resume_and_tools
from superoffload.config import OffloadConfig


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a small GPT on the embedded corpus with the offload engine",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{PROG} [options]   (--help lists them)",
    )
    add_arguments(p)
    from superoffload.distributed.process_group import add_parallel_args

    # --dp/--sp/--dist-backend/--dist-timeout-s (docs/distributed.md)
    add_parallel_args(p)
    p.set_defaults(func=_run)


def run_training(args: argparse.Namespace) -> dict[str, Any]:
    """Build model, data and engine from parsed arguments; train; write the report.
    Returns the JSON-able result (the CLI prints it); a run stopped by SIGINT/SIGTERM returns
    {"stopped": {...}}. Raises UsageError for bad input, before anything is written."""
    resume = None
    if args.resume is not None:
        resume = ck.find_resume_point(args.resume)
    # None unless under torchrun (or --dp/--sp > 1)
    dp = train_dist.start(args)
    try:
        return _train(_setup(args, dp, resume), args)
    finally:
        # the run folder is free for the next run
        run_lock.release_all()
        if dp is not None:
            from superoffload.distributed import shutdown

            shutdown()


@dataclass(slots=True)
class _Job:
    """What one process of a run is made of, before the engine starts."""

    s: RunSettings
    dp: Any
    """DistInfo under torchrun, else None."""
    resume: ck.ResumePoint | None
    device: torch.device
    out: Path
    model: torch.nn.Module
    batches: Any
    val: Any
    config: OffloadConfig
    info: dict[str, Any]
    rank: int = 0
    world: int = 1

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def launch(self) -> str:
        """How to start this run again (for the resume hint)."""
        if self.dp is None:
            return PROG
        return f"torchrun --nproc-per-node {self.world} -m superoffload train"


def _setup(args: argparse.Namespace, dp: Any, resume: ck.ResumePoint | None) -> _Job:
    from superoffload.data import BatchSampler, load_tokens, split_train_val

    # under torchrun the device is the one train_dist.start bound to this rank, not --device
    if dp is not None:
        device, rank, dp_size, sp_size = torch.device(dp.device), dp.rank, dp.dp, dp.sp
    else:
        device, rank, dp_size, sp_size = resolve_device(args.device), 0, 1, 1
    saved, warning = None, None
    if resume is not None:
        saved, warning = resume.run, resume.fallback_warning(args.resume)
    s = resolve_settings(args, device.type, dp=dp_size, sp=sp_size, saved=saved)
    check_resume_and_tools(args, s, resume, dp)
    # an absurd --seq/--batch for this machine: refused
    run_budget.check_budget(s, device)
    world = dp_size * sp_size
    # a damaged newest checkpoint was passed over
    if warning is not None and rank == 0:
        print(warning, file=sys.stderr, flush=True)
    # the folder before the model: a bad --out costs nothing
    if dp is None:
        out = prepare_run_folder(args.out, resume)
    else:
        # rank 0 makes the folder; a failure ends every rank with the same line
        made, error = None, None
        if rank == 0:
            try:
                made = prepare_run_folder(args.out, resume)
            except UsageError as exc:
                error = str(exc)
        out = train_dist.shared_out_dir(made, error)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[s.dtype]
    model = build_model(s).to(device=device, dtype=dtype)
    if s.sp > 1:
        train_dist.make_sequence_parallel(model, s.sp, s.seq)
    config = run_config(s, device)
    # --batch is the global batch; each rank takes its share
    batch = s.batch // s.dp
    train_tokens, val_tokens = split_train_val(load_tokens())
    rank_seed = s.seed
    # other data per rank: a data-parallel rank that drew its peers' batches would add nothing;
    # the ranks of one sp group share dp_rank, so they read the same sequences
    if dp is not None:
        rank_seed += 1000 * dp.dp_rank
    batches: Any = BatchSampler(train_tokens, batch_size=batch, seq_len=s.seq, seed=rank_seed)
    val: Any = BatchSampler(val_tokens, batch_size=batch, seq_len=s.seq, seed=s.seed + 1)
    # every rank of an sp group: the same sequences, its slice
    if s.sp > 1:
        batches, val = train_dist.SequenceShard(batches), train_dist.SequenceShard(val)
    info = {"model": "HF GPT-2 (tiny)" if s.hf else f"GPT {s.model}",
            "params": sum(p.numel() for p in model.parameters()), "device": str(device),
            "dtype": s.dtype, "batch": s.batch, "seq": s.seq, "lr": s.lr, "steps": s.steps,
            "preset": s.preset, "bucket_bytes": config.bucket_bytes, "ratio": config.ratio,
            "grad_cast": config.grad_cast, "param_cast": config.param_cast,
            "cpu_threads": config.cpu_threads, "speculation": config.speculation,
            "max_grad_norm": config.max_grad_norm, "weights": config.weights,
            "weight_decay": s.weight_decay, "warmup": s.warmup, "seed": s.seed,
            "torch_threads": torch.get_num_threads(), "dp": s.dp, "sp": s.sp,
            "batch_per_rank": batch, "seq_per_rank": s.seq // s.sp,
            "block_size": getattr(getattr(model, "config", None), "block_size", s.seq)}
    return _Job(s, dp, resume, device, out, model, batches, val, config, info, rank, world)


def _engine(job: _Job) -> Any:
    import superoffload as so

    groups = param_groups(job.model, job.s.weight_decay)
    for g in groups:
        g.update(lr=job.s.lr, betas=(0.9, 0.95))
    # FSDP2 over the job's mesh: dp x sp, HSDP with --dp-replicate
    if job.dp is not None:
        return train_dist.make_engine(job.model, groups, job.config)
    return so.initialize(job.model, optimizer=groups, config=job.config)


def _restore(job: _Job, engine: Any, scheduler: Any) -> Any:
    """--resume: engine, scheduler, this rank's data position; returns the Progress."""
    if job.resume is None:
        return None
    extra = engine.load_checkpoint(str(job.resume.path), lr_scheduler=scheduler)
    progress, samplers = ck.run_extra(extra, job.resume.path)
    if len(samplers) != job.world:
        raise UsageError(f"--resume {job.resume.path}: the checkpoint holds {len(samplers)} "
                         f"ranks' data positions, this launch has {job.world}")
    job.batches.load_state_dict(samplers[job.rank])
    return progress


def _train(job: _Job, args: argparse.Namespace) -> dict[str, Any]:
    from superoffload.train_loop import TrainSettings, make_scheduler, train

    s, dp = job.s, job.dp
    quiet = args.quiet or not job.lead
    settings = TrainSettings(steps=s.steps, warmup_steps=min(s.warmup, s.steps),
                             eval_batches=s.eval_batches)
    ckpts = ck.RunCheckpoints(job.out, keep=args.keep_checkpoints, lead=job.lead)
    saved: dict[str, Any] = {"step": None, "errors": []}
    with _engine(job) as engine:
        scheduler = make_scheduler(engine.optimizer, settings)
        progress = _restore(job, engine, scheduler)
        start = progress.step if progress is not None else 0
        if not args.json and not quiet:
            what = ""
            if job.resume is not None:
                what = f"from step {start} of {job.resume.path}, "
            grown = run_budget.grown_positions(s)
            print(f"training {job.info['model']}: {job.info['params'] / 1e6:.2f} M params on "
                  f"{job.device} ({s.dtype}), batch {job.info['batch_per_rank']} x {s.seq} "
                  f"tokens, {s.steps} steps; {what}{grown}output in {job.out}", flush=True)

        def extra_at(p: Any) -> dict[str, Any]:
            state = job.batches.state_dict()
            samplers = [state]
            # rank 0 writes the checkpoint: it carries every rank's data position
            if dp is not None:
                samplers = train_dist.gather_objects(state)
            return {"format": ck.RUN_FORMAT, "run": s.to_dict(), "progress": p.to_dict(),
                    "samplers": samplers}

        def on_checkpoint(p: Any) -> None:
            try:
                ckpts.save_step(engine, extra=extra_at(p), scheduler=scheduler)
                saved["step"] = p.step
            except Exception as exc:
                # a full disk must not end a healthy run
                msg = f"checkpoint at step {p.step} not written ({one_line(exc)})"
                if dp is not None:
                    raise CheckpointFailed(msg) from exc
                saved["errors"].append(msg)
                print(f"train: {msg}; training continues, earlier checkpoints are kept",
                      file=sys.stderr, flush=True)

        bar = None
        if not quiet:
            from tqdm import tqdm

            bar = tqdm(total=s.steps, initial=start, desc="train", unit="step",
                       file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

        def on_step(i: Any) -> None:
            if bar is not None:
                bar.update(1)
                # the dashboard's words
                bar.set_postfix_str(progress_postfix(i), refresh=False)

        # the evaluation's progress bar, once it starts
        evaluating: list[Any] = []

        def on_eval(done: int, total: int) -> None:
            if not quiet and not evaluating:
                from tqdm import tqdm

                if bar is not None:
                    # training is done: its bar shows the last step
                    bar.close()
                evaluating.append(tqdm(total=total, desc="eval", unit="batch",
                                       file=sys.stderr, dynamic_ncols=True, mininterval=0.5))
            for b in evaluating:
                b.update(1)

        with StopSignals(announce=job.lead) as signals:
            def should_stop() -> bool:
                asked = signals.signum != 0
                # one rank's signal stops all: a rank left alone would hang in a collective
                if dp is not None:
                    asked = train_dist.any_rank(asked)
                return asked

            # every rank logs the loss of the whole batch, not of its own share
            loss_reduce = train_dist.global_mean if dp is not None else None
            try:
                result = train(engine, job.model, job.batches, settings, val_batches=job.val,
                               on_step=on_step, loss_reduce=loss_reduce, scheduler=scheduler,
                               progress=progress, checkpoint_every=args.checkpoint_every,
                               on_checkpoint=on_checkpoint, should_stop=should_stop,
                               calibrator=train_calibration.auto_calibrator(job, engine),
                               steps_scope=signals.deferring(), on_eval_batch=on_eval)
            finally:
                for b in (bar, *evaluating):
                    if b is not None:
                        b.close()
        if result.stopped:
            signum = signals.signum
            # a signal reaches one rank or several: every rank must stop with the same code
            if dp:
                signum = train_dist.max_over_ranks(signals.signum)
            stop = ck.checkpoint_on_stop(
                ckpts, engine, step=result.steps, steps=s.steps, signum=signum,
                saved_step=saved["step"], extra=lambda: extra_at(result.progress()),
                scheduler=scheduler, launch=job.launch())
            return {"stopped": stop, "rank": job.rank}
        # before the report: it is the run's work
        if args.save_checkpoint:
            try:
                ckpts.save(engine, job.out / "checkpoint", extra=extra_at(result.progress()),
                           scheduler=scheduler)
            except Exception as exc:
                # keep result.json and the report
                saved["final_error"] = f"{job.out / 'checkpoint'}: {one_line(exc)}"
        return _finish(job, args, engine, result, saved)


def _finish(job: _Job, args: argparse.Namespace, engine: Any, result: Any,
            saved: dict[str, Any]) -> dict[str, Any]:
    """Report, trace, sample, result.json (rank 0 writes; every rank joins the gathers)."""
    from superoffload.telemetry.metrics import to_records
    from superoffload.telemetry.storage_io import storage_io

    stats = {k: getattr(engine.stats, k) for k in
             ("iterations", "skipped_steps", "clipped_steps", "rollbacks", "replays")}
    recorder = engine.telemetry
    spans = result.spans
    # rank 0's report shows every rank's lanes
    if job.dp is not None:
        spans = train_dist.gather_rank_spans(spans, recorder)
    report_path = trace_path = None
    if not (args.no_report or not job.lead):
        report_path = str(write_report(job.out, spans, recorder, result, job.info, stats,
                                       job.info["model"], job.device))
    if args.trace and job.lead:
        from superoffload.telemetry.trace import write_chrome_trace

        # one process: the recorder holds every span; data parallel: the gathered ranks' spans
        source = recorder if job.dp is None else spans
        trace_path = str(write_chrome_trace(source, job.out / "trace.json"))
    if job.s.sp > 1:
        from superoffload.distributed import remove_ulysses

        # a GPT (checked); generate() runs the whole sequence on one rank
        remove_ulysses(job.model)  # type: ignore[arg-type]
    sample = None
    # sample_text drives our GPT's generate (byte tokens, a seeded generator): not HF's API
    if not job.s.hf:
        sample = sample_text(job.model, job.device, temperature=args.sample_temperature,
                             top_k=args.sample_top_k, seed=job.s.seed)
    payload: dict[str, Any] = {
        **result.to_dict(), **job.info, "engine_stats": stats,
        "report": report_path, "out": str(job.out), "sample": sample, "trace": trace_path,
        "resumed_from": str(job.resume.path) if job.resume is not None else None,
        "start_step": result.start_step, "checkpoint_errors": saved["errors"],
        "final_checkpoint_error": saved.get("final_error"),
    }
    # docs/storage.md: rates, bytes
    if (tier_io := storage_io(result.spans)) is not None:
        payload["storage"] = tier_io.as_dict()
    # every rank trains on its own tokens: the job's rate is their sum
    if job.dp is not None:
        payload["tokens_per_s_per_rank"] = payload["tokens_per_s"]
        payload["tokens"] = payload["tokens"] * job.world
        payload["tokens_per_s"] = payload["tokens_per_s"] * job.world
        payload["rank"] = job.rank
    if job.lead:
        records = to_records(result.spans)
        (job.out / "result.json").write_text(json.dumps({**payload, "iterations": records},
                                                        indent=1))
    return payload


def _run(args: argparse.Namespace) -> int:
    try:
        result = run_training(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except CheckpointFailed as exc:
        print(f"train: {exc}; the run stopped (data parallel), earlier checkpoints are kept",
              file=sys.stderr)
        return 1
    stopped = result.get("stopped")
    if stopped is not None:
        if result.get("rank", 0) == 0:
            print(stopped["message"], file=sys.stderr, flush=True)
        return int(stopped["exit_code"])
    if result.get("rank", 0) != 0:
        # rank 0 speaks for the data-parallel job
        return 0
    if not args.quiet or not args.json:
        print_summary(result, args)
    if args.json:
        print(json.dumps(result), flush=True)
    if result.get("final_checkpoint_error"):
        print(f"train: the final checkpoint was not written ({result['final_checkpoint_error']}); "
              f"result.json and the report are in {result['out']}", file=sys.stderr, flush=True)
        return 1
    return 0
