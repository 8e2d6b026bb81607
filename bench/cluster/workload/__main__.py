"""python -m bench.cluster.workload convert mooncake TRACE.jsonl --out F.jsonl
python -m bench.cluster.workload convert claude-code [DIR] --out F.jsonl [--limit FILES] [--end-at-context N]
python -m bench.cluster.workload convert vllm-multiturn [CONFIG.json] --out F.jsonl [--seed S]
python -m bench.cluster.workload convert agent --sessions N --out F.jsonl [--seed S]
python -m bench.cluster.workload stats F.jsonl [--max-model-len N [--head-blocks H] [--low-water W]]

`convert` writes a session trace (workload/jsonl.py's format) and prints its stats; `stats`
prints a trace's, and with --max-model-len also how many requests the context cut
(workload/context.py) changes and the stats of the trace as the client sends it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.cluster.plan import TRACES
from bench.cluster.workload import agent, claude_code, mooncake, vllm_multiturn
from bench.cluster.workload.context import CutRule, cut_session
from bench.cluster.workload.jsonl import read_sessions, write_sessions
from bench.cluster.workload.model import Session
from bench.cluster.workload.stats import format_stats, trace_stats

DESCRIPTION = "Session traces for the cluster benchmark: convert, then read their figures."


def _convert(args: argparse.Namespace) -> list[Session]:
    if args.source == "mooncake":
        if args.input is None:
            raise SystemExit("convert mooncake needs the trace file")
        sessions, found = mooncake.infer_sessions(mooncake.read_records(args.input), name=args.input.stem)
        print(
            f"inferred {found.sessions:,} sessions from {found.requests:,} requests: "
            f"{found.turns_continued:,} turns continue a session ({found.whole_prefix_turns:,} of them "
            f"by the whole-hash_ids rule), {found.forks:,} forks started their own; common prefix "
            f"{found.common_prefix_blocks} block(s)"
        )
        return sessions
    if args.source == "claude-code":
        directory = args.input or TRACES / "claude-code"
        sessions, read = claude_code.convert(directory, limit=args.limit, max_model_len=args.end_at_context)
        print(
            f"read {read.files:,} files: {read.sessions:,} sessions ({read.subagents:,} subagents), "
            f"{read.requests:,} requests; {read.empty_stops:,} empty stops read as stop, "
            f"{read.think_times_from_t:,} think times from t, {read.outputs_raised:,} outputs of 0 sent as 1"
        )
        if args.end_at_context:
            print(
                f"ended at {args.end_at_context:,} tokens: {read.requests_cut:,} requests dropped, "
                f"{read.sessions_dropped:,} sessions whole"
            )
        return sessions
    if args.source == "vllm-multiturn":
        config = json.loads(args.input.read_text()) if args.input else vllm_multiturn.EXAMPLE_CONFIG
        return vllm_multiturn.generate(
            config, seed=args.seed, block_size=args.block_size, think_ms=args.think_ms
        )
    return agent.generate(
        agent.AgentLoop(), sessions=args.sessions, seed=args.seed, block_size=args.block_size
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster.workload", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="write a session trace")
    convert.add_argument("source", choices=["mooncake", "claude-code", "vllm-multiturn", "agent"])
    convert.add_argument(
        "input", nargs="?", type=Path, help="Mooncake trace, Claude Code traces' folder, or vLLM config"
    )
    convert.add_argument("--out", type=Path, required=True)
    convert.add_argument("--seed", type=int, default=0)
    convert.add_argument("--block-size", type=int, default=64, help="generators' block size (tokens)")
    convert.add_argument("--sessions", type=int, default=100, help="agent sessions")
    convert.add_argument("--think-ms", type=float, default=0.0, help="vllm-multiturn: mean think time")
    convert.add_argument("--limit", type=int, help="claude-code: the first LIMIT trace files only")
    convert.add_argument(
        "--end-at-context", type=int, help="claude-code: end sessions before a request past N tokens"
    )
    stats = commands.add_parser("stats", help="print a session trace's figures")
    stats.add_argument("trace", type=Path)
    stats.add_argument("--max-model-len", type=int, help="also cut contexts past this limit")
    stats.add_argument("--head-blocks", type=int, default=1, help="blocks the cut always keeps")
    stats.add_argument("--low-water", type=float, default=1.0, help="a cut leaves this fraction of the room")
    args = parser.parse_args(argv)

    if args.command == "convert":
        sessions = _convert(args)
        written = write_sessions(args.out, sessions)
        print(f"wrote {written:,} sessions to {args.out}")
    else:
        sessions = list(read_sessions(args.trace))
    print(format_stats(trace_stats(sessions)))
    if args.command == "stats" and args.max_model_len:
        rule = CutRule(args.max_model_len, head_blocks=args.head_blocks, low_water=args.low_water)
        cuts = [cut_session(s, rule) for s in sessions]
        changed = sum(n for _, n in cuts)
        print(f"\ncut at {args.max_model_len:,} tokens: {changed:,} requests cut")
        print(format_stats(trace_stats([s for s, _ in cuts])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
