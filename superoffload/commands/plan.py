"""`python -m superoffload plan --hf-config ...`: will this Hugging Face model fit, and how fast?

    python -m superoffload plan --hf-config path/to/config.json --profile h200-pcie --seq 4096
    python -m superoffload plan --hf-config llama-2-7b --profile gh200      # a shipped config
    python -m superoffload plan --hf-config deepseek-v2-lite.json --profile h100-sxm \
        --allow-bf16-moments       # the SuperOffload rows may use bf16 Adam moments

For each system -- plain (everything on the GPU), ZeRO-Offload, SuperOffload with stationary
weights and with weight-flow, and, when the profile has a storage tier, SuperOffload with it --
it prints whether the model fits, device, host and storage memory and the predicted iteration
time (plan.simulate, plan.memory); the SuperOffload rows are tuned (plan.tune with the weight
policy fixed; the tier row with ``Constraints(storage=True)``), a row with state on the tier
says how many tokens per step hide its traffic (plan/tier_budget.py), and the fastest fitting
row's OffloadConfig and the tuner's explanation close the report (``--allow-bf16-moments``:
the tuner may propose bf16 Adam moments, ``plan.tune``'s rule). The report says which share
of a shared host the job planned with (``--gpus-per-host``), where the main figures come from
(their provenance), which config keys were read and that a config's own code (``auto_map``)
was not run. Shipped configs: plan/hf_configs/*.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from superoffload.commands.planner_args import (
    dtype_arg,
    fail,
    load_profile,
    machine_args,
    memory_caps,
    model_dtype,
    with_machine,
)

ROWS = (
    ("plain (GPU only)", "gpu", None),
    ("ZeRO-Offload", "zero-offload", None),
    ("superoffload stationary", "superoffload", "stationary"),
    ("superoffload flow", "superoffload", "flow"),
)
"""(label, simulated system, fixed weight policy) per table row."""
TIER_ROW = "superoffload + storage"
"""The row that may keep state (and weight-flow's weights) on the storage tier: tuned with
``Constraints(storage=True)``, both weight policies; shown when the profile has a tier."""
CONFIG_KEYS = ("bucket_bytes", "ratio", "speculation", "grad_cast", "param_cast", "weights",
               "cpu_cores_frac", "prefetch_depth", "max_grad_norm", "optimizer_state_dtype",
               "storage_path", "host_memory_budget_bytes", "storage_buffer_count")


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="will a Hugging Face model fit a machine? (memory, time, settings)")
    p.add_argument("--hf-config", required=True, metavar="CONFIG",
                   help="config.json (or its directory) of a causal LM, or a shipped name: "
                        + ", ".join(_shipped()) + ". Llama, Mistral, Qwen2, GPT-2 and GPT-NeoX "
                        "are counted by formula; any other architecture transformers knows "
                        "(Mixtral, Gemma-2, Phi-3, Falcon, ...) is built on the meta device "
                        "(needs the hf extra)")
    dtype_arg(p, "training dtype of the weights (default bf16, whatever the config's "
                 "torch_dtype says: Gemma-2 ships float32 weights)")
    p.add_argument("--profile", default="gh200",
                   help="hardware preset (gh200, gb200, mi300a, h100-pcie, h200-pcie, ...), "
                        "'local' (measure this machine) or a profile JSON file")
    machine_args(p)
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the model's context, "
                                           "at most 4096)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--no-checkpointing", action="store_true",
                   help="no activation checkpointing (more activation memory, no recompute)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (figures per rank)")
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument("--max-grad-norm", type=float, help="clipping threshold the run will use")
    p.add_argument("--device-gb", type=float, help="cap on device memory, GB")
    p.add_argument("--host-gb", type=float, help="cap on host memory, GB")
    p.add_argument("--allow-bf16-moments", action="store_true",
                   help="let the SuperOffload rows use bf16 Adam moments on the host (4 B/param "
                        "less host memory; changes the numerics: proposed only when it pays "
                        "or only it fits, and said so)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run)


def _shipped() -> list[str]:
    from superoffload.plan import hf_config

    return hf_config.shipped()


def system_rows(shape: Any, prof: Any, constraints: Any = None) -> list[dict[str, Any]]:
    """One dict per row of ROWS: `system` (the row's label), `fits`, `problems`,
    `device_bytes`, `host_bytes`, `iteration_s`, `tflops`, `config` (tuned OffloadConfig
    fields, SuperOffload rows) and `explanation` (the tuner's). Pure planner calls; notebooks
    use it too."""
    from superoffload import plan

    cons = constraints if constraints is not None else plan.Constraints()
    rows = [_row(label, system, weights, shape, prof, cons) for label, system, weights in ROWS]
    if cons.apply(prof).has_storage:
        rows.append(_tier_row(shape, prof, cons, rows))
    return rows


def _tier_row(shape: Any, prof: Any, cons: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The storage tier's row: tuned with the tier allowed; a model that fits host memory
    keeps nothing there, so then it is the fastest in-memory SuperOffload row (the tier adds
    nothing but a folder to name)."""
    row = _row(TIER_ROW, "superoffload", None, shape, prof,
               dataclasses.replace(cons, storage=True))
    fitting = [r for r in rows if r["fits"] and r["config"] is not None]
    if fitting and not row.get("storage_bytes"):
        best = min(fitting, key=lambda r: r["iteration_s"])
        row = {**best, "system": TIER_ROW,
               "note": f"fits in host memory: as {best['system']}, nothing on the tier"}
    return row


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest row that fits, or None."""
    fitting = [r for r in rows if r["fits"]]
    return min(fitting, key=lambda r: r["iteration_s"], default=None)


def _row(label: str, system: str, weights: str | None, shape: Any, prof: Any,
         cons: Any) -> dict[str, Any]:
    """One system: a simulation (plain, ZeRO-Offload) or a tune with `weights` fixed."""
    from superoffload import plan
    from superoffload.plan.tier_budget import tier_cost

    out: dict[str, Any] = {"system": label, "config": None}
    if system != "superoffload":
        res = plan.simulate(shape, cons.apply(prof), system)
        why = ""
    else:
        try:
            fixed = cons
            # one row per weight policy: pin it, so the tuner does not pick the other row's
            if weights is not None:
                fixed = dataclasses.replace(cons, fixed={**cons.fixed, "weights": weights})
            cfg, why, res = plan.tune(shape, prof, fixed)
        except plan.InfeasibleError as exc:
            return {**out, "fits": False, "problems": [str(exc)], "device_bytes": None,
                    "host_bytes": None, "storage_bytes": None, "iteration_s": None,
                    "tflops": None, "explanation": "", "storage_io": None}
        out["config"] = {k: getattr(cfg, k) for k in CONFIG_KEYS}
    storage_io = None
    # only SuperOffload's plan may keep state on the storage tier: the baselines have no tier
    if system == "superoffload":
        cost = tier_cost(shape, cons.apply(prof), res.plan)
        # None: the plan keeps nothing on the tier, so there is no traffic to hide
        if cost is not None:
            storage_io = {"read_bytes": cost.read_bytes, "write_bytes": cost.write_bytes,
                          "io_s": cost.io_s, "tokens_needed": cost.tokens_needed,
                          "tokens_per_step": cost.tokens_per_step,
                          "storage_busy": res.lanes["storage"].utilization,
                          "weight_homes_in_files": _filed(shape, res)}
    return {**out, "fits": res.fits, "problems": list(res.problems),
            "device_bytes": res.memory["device"], "host_bytes": res.memory["host"],
            "storage_bytes": res.memory["storage"], "iteration_s": res.iteration_s,
            "tflops": res.tflops, "explanation": why,
            "host_parts": dict(res.memory_detail.host_parts), "storage_io": storage_io}


def _run(args: argparse.Namespace) -> int:
    from superoffload import plan
    from superoffload.plan import hf_config
    from superoffload.plan.calibrate import calibration_state

    try:
        raw = hf_config.load_config(args.hf_config)
        shape = plan.ModelShape.from_hf_config(
            raw, seq=args.seq, micro_batch=args.micro_batch,
            activation_checkpointing=not args.no_checkpointing, dp=args.dp,
            ranks_per_host=args.ranks_per_host, **model_dtype(args))
        model = _model(raw, shape)
        prof = with_machine(load_profile(args.profile), args)
        cons = plan.Constraints(**memory_caps(args), max_grad_norm=args.max_grad_norm,
                                allow_bf16_moments=args.allow_bf16_moments)
        rows = system_rows(shape, prof, cons)
    except (ValueError, TypeError, FileNotFoundError, OSError) as exc:
        return fail(str(exc), args.json)
    best = best_row(rows)
    calibrated = calibration_state(prof)
    if args.json:
        print(json.dumps({"model": model, "profile": prof.name, "calibrated": calibrated.calibrated,
                          "calibration": calibrated.text, "rows": rows,
                          "best": None if best is None else best["system"],
                          "host_share": _share(prof, shape),
                          "figures": {name: {"value": value, "provenance": kind,
                                             "source": prof.source(name)}
                                      for name, value, kind in prof.figures()}},
                         indent=1, default=float))
        return 0
    print(_report(model, prof, shape, rows, best))
    print(f"\npredictions: {calibrated.text}")
    return 0


def _model(raw: dict[str, Any], shape: Any) -> dict[str, Any]:
    """What the report says about the model: its config's numbers and the shape's counts."""
    from superoffload.plan import hf_config, hf_meta

    if str(raw.get("model_type", "")) in hf_config.FAMILIES:
        arch = hf_config.arch_of(raw)
        model = {"name": arch.name, "family": arch.family, "layers": arch.layers,
                 "hidden": arch.hidden, "heads": arch.heads, "kv_heads": arch.kv_heads,
                 "ffn": arch.ffn, "vocab": arch.vocab, "experts": 0, "experts_per_token": 0}
    else:
        model = hf_meta.describe_model(raw, shape.to_dict())
    read, not_read = hf_config.config_keys(raw)
    return {**model, "params": shape.params, "active_params": shape.active_params,
            "active_params_without_embedding": shape.active_params - shape.vocab * shape.hidden,
            "tied_embeddings": shape.tied_embeddings, "seq": shape.seq,
            "micro_batch": shape.micro_batch, "dtype": shape.dtype,
            "config_keys_read": list(read), "config_keys_not_read": list(not_read),
            "remote_code_ignored": bool(raw.get("auto_map"))}


def _report(model: dict[str, Any], prof: Any, shape: Any, rows: list[dict[str, Any]],
            best: dict[str, Any] | None) -> str:
    gqa = f"{model['heads']} heads"
    # grouped-query attention: fewer KV heads than query heads shrink the KV projections
    if model["kv_heads"] != model["heads"]:
        gqa += f" ({model['kv_heads']} KV)"
    moe = ""
    # a mixture of experts keeps every expert in memory but runs only the active ones: the
    # FLOPs follow the active parameters without the embedding table (a lookup, no matmul)
    if model["experts"]:
        moe = (f"; MoE, {model['experts_per_token']} of {model['experts']} experts per token: "
               f"{model['active_params'] / 1e9:.2f}B active parameters "
               f"({model['active_params_without_embedding'] / 1e9:.2f}B without the embedding "
               f"table: the FLOPs), all {model['params'] / 1e9:.2f}B in memory")
    head = "tied" if model["tied_embeddings"] else "untied"
    checkpointing = "on" if shape.activation_checkpointing else "off"
    ranks = ""
    # under data parallel every figure of the table is one rank's
    if shape.dp > 1:
        ranks = f", {shape.dp} data-parallel ranks (figures per rank)"
    lines = [
        f"{model['name']} ({model['family']}): {model['params'] / 1e9:.2f}B parameters "
        f"({model['params']:,}); {model['layers']} layers x {model['hidden']}, {gqa}, FFN "
        f"{model['ffn']}, vocab {model['vocab']}, {head} head, {model['dtype']}{moe}",
        f"{prof.name}: {prof.device_name} ({prof.device_memory_bytes / 1e9:.0f} GB) + "
        f"{prof.cpu_name} ({prof.host_memory_bytes / 1e9:.0f} GB); seq {shape.seq} x "
        f"micro-batch {shape.micro_batch}, activation checkpointing {checkpointing}{ranks}",
        _share_line(_share(prof, shape)),
        _figures_line(prof),
        _keys_line(model),
        "",
        f"{'system':24} {'fits':>4} {'device GB':>10} {'host GB':>8} {'storage GB':>10} "
        f"{'iter ms':>9} {'TFLOPS':>7}  notes",
    ]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        def num(key: str, scale: float, fmt: str, row: dict[str, Any] = r) -> str:
            width = fmt.split(".")[0]
            # a figure a refused row does not have: a dash, right-aligned as the numbers are
            if row[key] is None:
                return format("-", ">" + width)
            return format(row[key] * scale, fmt)

        # a row that does not fit says why; one that fits, its own note or the tuned settings
        note = r.get("note") or ""
        if not r["fits"]:
            note = "; ".join(r["problems"])
        elif not note and r["config"]:
            note = "tuned: " + _settings(r["config"])
        fits = "yes" if r["fits"] else "NO"
        lines.append(f"{r['system']:24} {fits:>4} "
                     f"{num('device_bytes', 1e-9, '10.1f')} {num('host_bytes', 1e-9, '8.1f')} "
                     f"{num('storage_bytes', 1e-9, '10.1f')} {num('iteration_s', 1e3, '9.1f')} "
                     f"{num('tflops', 1.0, '7.0f')}  {note}".rstrip())
    lines.append("")
    lines.extend(_tier_lines(rows))
    if best is None:
        lines.append("Nothing fits this profile: see the notes above (more host memory, "
                     "data-parallel ranks --dp, a shorter --seq or checkpointing help).")
        return "\n".join(lines)
    zero = next(r for r in rows if r["system"] == "ZeRO-Offload")
    speed = ""
    # a speed-up only against a ZeRO-Offload that fits, never of ZeRO-Offload over itself
    if zero["fits"] and best is not zero:
        speed = f" ({zero['iteration_s'] / best['iteration_s']:.2f}x faster than ZeRO-Offload)"
    lines.append(f"Best: {best['system']}, {best['iteration_s'] * 1e3:.1f} ms per iteration"
                 f"{speed}.")
    if best["config"]:
        settings = ", ".join(f"{k}={v!r}" for k, v in best["config"].items())
        lines.append(f"OffloadConfig({settings})")
        lines.append("")
        lines.append(best["explanation"])
    return "\n".join(lines)


def _keys_line(model: dict[str, Any]) -> str:
    """Which config keys the plan read, and that a config's own code was not run."""
    line = (f"config keys read: {', '.join(model['config_keys_read']) or '-'}; not read: "
            f"{', '.join(model['config_keys_not_read']) or '-'}")
    if model["remote_code_ignored"]:
        line += (f"\nauto_map names the model's own code: not run; planned from transformers' "
                 f"{model['family']} as data")
    return line


def _settings(cfg: dict[str, Any]) -> str:
    parts = [f"ratio {cfg['ratio']:g}", f"buckets {cfg['bucket_bytes'] >> 20} MiB",
             f"cast {cfg['grad_cast']}/{cfg['param_cast']}", f"STV {cfg['speculation']}"]
    if cfg["optimizer_state_dtype"] != "fp32":
        parts.append(f"{cfg['optimizer_state_dtype']} moments (numerics change)")
    if cfg["weights"] == "flow":
        parts.append(f"prefetch {cfg['prefetch_depth']}")
    if cfg.get("storage_path"):
        budget = cfg.get("host_memory_budget_bytes")
        tier = "storage tier (name a folder for storage_path)"
        if budget:
            tier += f", host budget {budget / 1e9:.0f} GB"
        parts.append(tier)
    return ", ".join(parts)


def _share(prof: Any, shape: Any) -> dict[str, Any]:
    """This rank's share of the host (plan.parallel.rank_profile): what the rows were
    planned against."""
    from superoffload.plan.parallel import host_share, rank_profile

    mine = rank_profile(prof, shape.ranks_per_host)
    storage = None
    if mine.has_storage:
        storage = {"name": prof.storage_name, "read_gbps": mine.storage_read_gbps,
                   "write_gbps": mine.storage_write_gbps, "bytes": mine.storage_bytes,
                   "queue_depth": mine.storage_queue_depth}
    return {"ways": host_share(prof, shape.ranks_per_host), "gpus_per_host": prof.gpus_per_host,
            "host_memory_bytes": mine.host_memory_bytes, "cpu_cores": mine.cpu_cores,
            "host_mem_bw_gbps": mine.host_mem_bw_gbps, "storage": storage}


def _share_line(share: dict[str, Any]) -> str:
    """Three tiers of memory this job plans with, its share of a shared host said."""
    ways = share["ways"]
    whole = "the whole host"
    # GPUs of one host share its memory and cores (plan.parallel.host_share): say so, and how
    # to give this job all of it
    if ways > 1:
        whole = (f"1/{ways} of the host (--gpus-per-host {share['gpus_per_host']}: GPUs "
                 "sharing it; --gpus-per-host 1 gives this job all of it)")
    tier = share["storage"]
    storage = "no storage tier (--storage names one)"
    if tier is not None:
        storage = (f"storage {tier['bytes'] / 1e12:.2f} TB at {tier['read_gbps']:.1f} GB/s "
                   f"read / {tier['write_gbps']:.1f} write, {tier['queue_depth']} requests in "
                   f"flight ({tier['name']})")
    return (f"this job: {whole}: host {share['host_memory_bytes'] / 1e9:.0f} GB, "
            f"{share['cpu_cores']} cores, {share['host_mem_bw_gbps']:.0f} GB/s; {storage}")


FIGURES = ("device_achieved_tflops", "device_memory_bytes", "h2d_gbps", "d2h_gbps",
           "host_memory_bytes", "host_mem_bw_gbps", "cpu_cores",
           "cpu_adam_params_per_s_per_core", "storage_read_gbps", "storage_write_gbps")
"""The figures whose provenance the report shows (--json: every figure)."""


def _figures_line(prof: Any) -> str:
    """Where the main figures come from (HardwareProfile.provenance)."""
    kinds = {name: kind for name, _, kind in prof.figures()}
    shown = [f"{name} {kinds[name] or 'uncited'}" for name in FIGURES if name in kinds]
    return "figures: " + ", ".join(shown) + " (--json: every figure and its source)"


def _tier_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per row with state on the tier: its traffic and the tokens per step that hide it."""
    out = []
    for r in rows:
        io = r.get("storage_io")
        if not r["fits"] or io is None:
            continue
        hidden = "NOT hidden: the step waits for the drives"
        # forward and backward take time per token: from tokens_needed on they cover the I/O
        if io["tokens_per_step"] >= io["tokens_needed"]:
            hidden = "hidden"
        blocks = ""
        if io["weight_homes_in_files"]:
            blocks = f"; the weights of {io['weight_homes_in_files']} buckets there"
        out.append(f"{r['system']}: the storage tier moves {io['read_bytes'] / 1e9:.1f} GB in "
                   f"and {io['write_bytes'] / 1e9:.1f} GB out per optimizer step "
                   f"({io['io_s']:.2f} s of the drives, {io['storage_busy']:.0%} busy{blocks}); "
                   f"forward and backward hide it from {io['tokens_needed']:,} tokens per step "
                   f"(this run: {io['tokens_per_step']:,}, {hidden})")
    return out + ([""] if out else [])


def _filed(shape: Any, res: Any) -> int:
    """Buckets whose weight-flow home is in the tier's files (plan/storage.py's rule)."""
    from superoffload.plan.memory_host import host_side

    # units exist only under FSDP2 data parallel (plan/memory.py): then each rank holds its
    # 1/dp shard of every bucket; without them the one process holds all of it
    dp = shape.dp if res.plan.units is not None else 1
    tier = host_side(shape, res.plan, dp).tier
    return 0 if tier is None else len(tier.file_homes)
