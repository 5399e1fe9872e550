"""``memfit`` command line: parse -> build the config -> call one function -> print, exit code.

User mistakes print one line per problem and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from rich.console import Console

from memfit.commands import launch_line
from memfit.config import TrainConfig, from_mapping, load_config_file
from memfit.dependencies import check_transformers
from memfit.errors import ConfigError, MemfitError, NothingFits, messages
from memfit.names import PRESETS
from memfit.options import NO_CLIP, build_parser
from memfit.views import (
    TraceProgress,
    print_cached_models,
    print_devices,
    print_estimate,
    print_gpu_count,
    print_plan,
    print_quantize,
)


def run_bench_command(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from memfit.bench import markdown, run_bench
    from memfit.bench_config import BenchConfig

    config = BenchConfig(model=args.model, data=args.data, max_length=args.max_length,
                         effective_batch=args.effective_batch, samples=args.samples, val_samples=args.val_samples,
                         epochs=args.epochs, lr=args.lr, seed=args.seed, device_profile=args.device_profile,
                         emulate_budget=args.emulate_budget, margin=args.margin, setups=tuple(args.setups),
                         output_dir=args.output_dir, quick=args.quick, speed_rounds=args.speed_rounds,
                         speed_steps=args.speed_steps, **_columns(args))
    words = list(sys.argv[1:] if argv is None else argv)
    result = run_bench(config, command=" ".join(["memfit", *words]),
                       log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(result.to_dict()) if args.json else markdown(result), end="\n" if args.json else "")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from memfit.planner.allowed import Allowed
    from memfit.planner.request import PlanRequest

    request = PlanRequest(
        model=args.model, task=args.task, seq_len=args.seq_len, image_size=args.image_size,
        effective_batch=args.effective_batch, num_labels=args.num_labels, max_target_length=args.max_target_length,
        device=args.device, budget=args.budget, margin=args.margin, gpus=args.gpus, distributed=args.distributed,
        gpus_per_node=args.gpus_per_node, host_memory=args.host_memory,
        precision=args.precision, optimizer=args.optimizer, allow=Allowed.of(args), lora_rank=args.lora_rank,
        exact_trace=args.exact_trace, options=load_config_file(args.config) if args.config else {})
    if args.max_gpus is not None:
        return _plan_gpu_count(request, args)
    with contextlib.nullcontext(None) if args.json else TraceProgress() as progress:
        result = request.run(progress=progress)
    if args.save:
        result.save(args.save)
    if args.json:
        print(json.dumps(result.to_dict()))
    elif args.emit == "trainer" and result.chosen is not None:
        from memfit.integrations.trainer_plan import trainer_snippet

        print(trainer_snippet(result))
    else:
        print_plan(Console(width=max(Console().width, 150)), result, top=args.top)
        if args.save:
            launch = launch_line(result.chosen.world_size if result.chosen else 1, result.gpus_per_node)
            print(f"saved to {args.save}; train with: {launch} train --plan {args.save}")
    if result.chosen is None:
        sys.stderr.write(f"memfit: nothing fits: {result.verdict.removeprefix('nothing fits ')}\n")
        return 1
    return 0


def _plan_gpu_count(request: Any, args: argparse.Namespace) -> int:
    """``memfit plan --max-gpus N``: every technique on every number of GPUs up to N."""
    from memfit.planner.gpu_count import plan_gpu_count

    if args.emit == "trainer":
        raise ConfigError("--emit trainer prints one plan's Trainer code; drop --max-gpus, or plan the number of "
                          "GPUs you will use with --gpus N")
    with contextlib.nullcontext(None) if args.json else TraceProgress() as progress:
        counted = plan_gpu_count(request, args.max_gpus, progress=progress)
    chosen = counted.chosen
    if args.save and chosen is not None:
        chosen.plan.save(args.save)
    if args.json:
        print(json.dumps(counted.to_dict()))
    else:
        print_gpu_count(Console(width=max(Console().width, 150)), counted)
        if args.save and chosen is not None:
            launch = launch_line(chosen.gpus, chosen.plan.gpus_per_node)
            print(f"saved to {args.save}; train with: {launch} train --plan {args.save}")
    if chosen is None:
        sys.stderr.write(f"memfit: {counted.verdict()}\n")
        return 1
    return 0


NOT_CONFIG = ("command", "config", "json", "profile", "seq_len", "image_size", "steps", "quantize", "full_length",
              "dry_run", "words", "exact_trace")


def _columns(args: argparse.Namespace) -> dict[str, str]:
    return {name: getattr(args, name) for name in ("text_column", "label_column") if getattr(args, name)}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """File values first, then every flag the user actually gave."""
    values: dict[str, Any] = load_config_file(args.config) if args.config else {}
    given = {name: value for name, value in vars(args).items()
             if value is not None and name not in NOT_CONFIG}
    batch_size = given.pop("batch_size", None)
    if batch_size is not None:
        given["micro_batch_size"] = batch_size
        given.setdefault("effective_batch", batch_size * given.get("world_size", 1))  # per rank, no accumulation
    if given.get("max_grad_norm") == NO_CLIP:
        given["max_grad_norm"] = None
    return from_mapping({**values, **given})


def run_estimate(args: argparse.Namespace) -> int:
    from memfit.memory.estimate import estimate

    result = estimate(config_from_args(args), device=args.profile, seq_len=args.seq_len,
                      image_size=args.image_size, steps=args.steps, padded=not args.full_length,
                      exact_trace=args.exact_trace)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print_estimate(Console(), result)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from memfit.generate import generate

    print(generate(args.model, args.prompt, max_new_tokens=args.max_new_tokens, raw=bool(args.raw)))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from memfit import quantize as quantization

    print(json.dumps(quantization.run_eval(args.model, data=args.data, columns=_columns(args))))
    return 0


def run_quantize(args: argparse.Namespace) -> int:
    from memfit import quantize as quantization

    report = quantization.run_quantize(args.source, method=args.method, backend=args.backend,
                                       data=args.data, output_dir=args.output_dir, columns=_columns(args))
    if args.json:
        print(json.dumps(report))
    else:
        print_quantize(Console(), report)
    return 0


def run_train(args: argparse.Namespace) -> int:
    from memfit.distributed import launched_rank
    from memfit.engine import train

    console = Console(stderr=True) if args.json else Console()
    config = config_from_args(args)
    try:
        if args.dry_run:
            from memfit.resolved import dry_run

            planned = dry_run(config, console=console)
            if args.json:
                print(json.dumps(planned.to_dict()))
            return 0
        summary = train(config, console=console)
    except NothingFits as error:
        raise ConfigError(with_command(error, args.words, given=config.opt_ins)) from None
    if launched_rank() != 0:  # under torchrun, rank 0 alone reports
        return 0
    if args.quantize:
        from memfit import quantize as quantization

        print_quantize(console, quantization.run_quantize(summary.output_dir))
    if args.json:
        print(json.dumps(summary.to_dict()))
    return 0


def with_command(error: NothingFits, words: list[str], *, given: tuple[str, ...]) -> str:
    """The planner's verdict and the command that trains with the first opt-in that would fit and that the run
    does not give yet (``given``: its opt-ins, from the command line or a config file)."""
    from memfit.distributed import launched_per_node, launched_world_size

    missing = next(([flag for flag in fix if flag not in given] for fix in error.fixes
                    if any(flag not in given for flag in fix)), None)
    if missing is None:
        return error.verdict
    kept = [word for word in words if word != "--dry-run"]
    launch = launch_line(launched_world_size(), launched_per_node())
    command = " ".join([launch, *(shlex.quote(word) for word in kept), *missing])
    return f"{error.verdict}; to train with the first: {command}"


def run_listing(args: argparse.Namespace) -> int:
    if args.command == "models":
        print("\n".join(PRESETS))
        print_cached_models()
    else:
        print_devices(Console())
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from memfit.serve import serve

    return serve(host=args.host, port=args.port, queue_limit=args.queue)


LISTINGS = ("models", "devices")
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": run_train, "estimate": run_estimate, "plan": run_plan, "generate": run_generate, "eval": run_eval,
    "quantize": run_quantize, "models": run_listing, "devices": run_listing, "serve": run_serve}
"""Each subcommand's handler (``bench`` also needs the command line it reports)."""


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.words = list(sys.argv[1:] if argv is None else argv)
    try:
        check_transformers()  # one line naming the upgrade, before anything imports an older one
        with _quiet(args.command):
            if args.command == "bench":
                return run_bench_command(args, argv)
            return COMMANDS[args.command](args)
    except MemfitError as error:
        for line in messages(error):
            sys.stderr.write(f"{line}\n")
        return error.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("memfit: interrupted\n")
        return 130


def _quiet(command: str) -> contextlib.AbstractContextManager[None]:
    """transformers' own warnings and progress bars stay out of memfit's output (the listings never load it)."""
    if command in LISTINGS or command == "serve":  # serve's plans are quiet in its worker
        return contextlib.nullcontext()
    from memfit.quiet import quiet_transformers

    return quiet_transformers()


def run() -> NoReturn:
    raise SystemExit(main())
