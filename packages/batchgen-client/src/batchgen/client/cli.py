"""The `batchgen` command: submit a batch and wait for it, look at batches, fetch and follow results.

    batchgen submit input.jsonl -o output.jsonl --max-decoding-length 512
    batchgen status batch_abc            # the batch object, as JSON on stdout (stderr: AT RISK)
    batchgen tail batch_abc --errors     # result lines as the server writes them
    batchgen watch                       # progress bars of every active batch, until they end
    batchgen download batch_abc -o output.jsonl
    batchgen retry batch_abc -o merged.jsonl   # rerun what failed, write the best result of each

The server is `--base-url`, else $BATCHGEN_BASE_URL, else http://localhost:10900. The API key is
`--api-key`, else $BATCHGEN_API_KEY, else $OPENAI_API_KEY (sent as `Authorization: Bearer KEY`;
none is sent when none is set). JSON and result lines go to stdout; progress, notices and errors go
to stderr.

Exit status:
    0    success
    1    the batch ended failed, expired or cancelled (submit, tail; for watch: any of them), or
         has no such result file (download)
    2    usage error: bad arguments, an input file that cannot be read, an output folder that
         does not exist
    3    the server answered with an error (its message is printed) or with something unreadable
    4    the server could not be reached, even after retrying
    5    the server refused the API key (401: missing, wrong or revoked); it is not retried
    6    submit --retry-failed: the batches completed, but requests are still failed once the
         retries ended (their errors are not retryable, or N retries did not fix them)
    130  interrupted (Ctrl-C); a submitted batch keeps running on the server
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from batchgen.client._arguments import non_negative_float, non_negative_int, positive_float, positive_int
from batchgen.client._cache_savings import format_cache_savings
from batchgen.client._chunked import DEFAULT_CHUNKED_THRESHOLD
from batchgen.client._client import BatchGenHttpClient
from batchgen.client._exceptions import (
    APIConnectionError,
    APIStatusError,
    BatchGenClientError,
    batch_error_summary,
)
from batchgen.client._line_errors import LineTally
from batchgen.client._options import BatchOptions, flag_of
from batchgen.client._progress import AT_RISK_MARKER, is_at_risk
from batchgen.client._requests import DEFAULT_BASE_URL, ENDPOINTS, JSONObject
from batchgen.client._retry import RetryPolicy
from batchgen.client._wait import ADAPTIVE_POLLING
from batchgen.client._watch import active_batch_ids, board_for, watch_batches
from batchgen.client._wording import count_of

__all__ = [
    "BASE_URL_ENV",
    "EXIT_BATCH_FAILED",
    "EXIT_CANNOT_CONNECT",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_REQUESTS_FAILED",
    "EXIT_SERVER_ERROR",
    "EXIT_UNAUTHORIZED",
    "EXIT_USAGE",
    "build_parser",
    "main",
]

EXIT_OK = 0
EXIT_BATCH_FAILED = 1
EXIT_USAGE = 2
EXIT_SERVER_ERROR = 3
EXIT_CANNOT_CONNECT = 4
EXIT_UNAUTHORIZED = 5
EXIT_REQUESTS_FAILED = 6
EXIT_INTERRUPTED = 130

BASE_URL_ENV = "BATCHGEN_BASE_URL"
#: Where the API key is read from when --api-key is not given, in this order.
API_KEY_ENVS = ("BATCHGEN_API_KEY", "OPENAI_API_KEY")
PROG = "batchgen"

logger = logging.getLogger("batchgen.client")


class UsageError(Exception):
    """A problem with the command line found after parsing it (exit status 2)."""


Command = Callable[[BatchGenHttpClient, argparse.Namespace], int]


# --- the commands -------------------------------------------------------------------------------


def _submit(client: BatchGenHttpClient, args: argparse.Namespace) -> int:
    input_path = Path(args.file)
    if not input_path.is_file():
        raise UsageError(f"cannot read the input file {args.file!r}")
    for path in (args.output, args.error_output):
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"the folder of {path!r} does not exist")
    if args.retry_failed and args.error_output is not None:
        raise UsageError("--retry-failed writes every request's best line to --output; drop --error-output")
    seen: list[JSONObject] = []

    def announce(batch: JSONObject) -> None:
        if not seen or seen[-1].get("id") != batch.get("id"):
            kind = "batch" if not seen else "retry batch"
            _say(f"{kind} {batch.get('id')} created; waiting for it (Ctrl-C stops waiting, not the batch)")
        seen.append(batch)

    try:
        batch = client.submit_batch(
            input_path,
            args.output,
            args.endpoint,
            poll_interval=args.poll_interval,
            error_file_path=args.error_output,
            progress=False if args.no_progress else None,
            on_progress=announce,
            retry_failed=args.retry_failed,
            chunked_upload_threshold=args.chunked_upload_threshold,
            **_batch_options(args),
        )
    except KeyboardInterrupt:
        if seen:
            batch_id = seen[-1].get("id")
            _say(f"stopped waiting; batch {batch_id} keeps running (see `{PROG} status {batch_id}`)")
        raise
    _print_json(batch)
    _say_cache_savings(batch)
    made = batch.get("retries") or []
    if not args.retry_failed:
        return _exit_for(batch)
    last = client.get_batch(made[-1]) if made else batch
    retries = count_of(len(made), "retry", "retries")
    _say(f"{retries} made; wrote the merged results of {batch.get('id')} to {args.output}")
    ended = _exit_for(last)
    if ended != EXIT_OK:
        return ended
    return _exit_for_failures(_tally_file(Path(args.output)), retries)


def _tally_file(path: Path) -> LineTally:
    """The tally of the result lines in a file."""
    tally = LineTally()
    with path.open("rb") as lines:
        while chunk := lines.read(1 << 20):
            tally.feed(chunk)
    return tally.finish()


def _exit_for_failures(tally: LineTally, retries: str) -> int:
    """0 when no request is left failed; otherwise say which failed and why, and 6."""
    if not tally.failed:
        return EXIT_OK
    reasons = []
    if tally.permanent:
        reasons.append(
            f"{count_of(tally.permanent.total(), 'request')} with an error no retry can fix "
            f"({_by_code(tally.permanent)})"
        )
    if tally.retryable:
        reasons.append(
            f"{count_of(tally.retryable.total(), 'request')} still failing after {retries} "
            f"({_by_code(tally.retryable)})"
        )
    _say(f"{count_of(tally.failed, 'request')} failed: " + "; ".join(reasons))
    return EXIT_REQUESTS_FAILED


def _by_code(counts: Counter[str]) -> str:
    return ", ".join(f"{code}: {count:,}" for code, count in counts.most_common())


def _retry(client: BatchGenHttpClient, args: argparse.Namespace) -> int:
    if args.output is not None and not Path(args.output).resolve().parent.is_dir():
        raise UsageError(f"the folder of {args.output!r} does not exist")
    options = {option.name: getattr(args, option.name) for option in fields(BatchOptions)}
    if options["metadata"] is not None:
        options["metadata"] = dict(options["metadata"])
    outcomes = None if args.only is None else [args.only]
    retry = client.retry_batch(args.id, outcomes, **options)
    if args.output is None and not args.wait:
        _print_json(retry)
        return EXIT_OK
    _say(f"retry batch {retry.get('id')} of {args.id} created; waiting for it")
    retry = client.wait_for_batch(
        retry["id"], poll_interval=args.poll_interval, progress=False if args.no_progress else None
    )
    _print_json(retry)
    if args.output is not None:
        path = client.download_merged_results_to(args.id, args.output)
        size = count_of(path.stat().st_size, "byte")
        _say(f"wrote the merged results of {args.id} and its retries to {path} ({size})")
    return _exit_for(retry)


def _status(client: BatchGenHttpClient, args: argparse.Namespace) -> int:
    batch = client.get_batch(args.id)
    _print_json(batch)
    _say_cache_savings(batch)
    if is_at_risk(batch):
        _say(f"batch {batch.get('id')}: {AT_RISK_MARKER} (at {batch.get('expires_at')}, Unix seconds)")
    return EXIT_OK


def _say_cache_savings(batch: JSONObject) -> None:
    """On stderr, what the server's result cache saved the batch, when it saved anything."""
    savings = format_cache_savings(batch)
    if savings is not None:
        _say(f"batch {batch.get('id')}: {savings}")


def _list(client: BatchGenHttpClient, args: argparse.Namespace) -> int:
    _print_json(client.list_batches(after=args.after, limit=args.limit))
    return EXIT_OK


def _cancel(client: BatchGenHttpClient, args: argparse.Namespace) -> int:
    _print_json(client.cancel_batch(args.id))
    return EXIT_OK


def _pool(client: BatchGenHttpClient, args: argparse.Namespace) -> int:
    _print_json(client.pool_status())
    return EXIT_OK


def _download(client: BatchGenHttpClient, args: argparse.Namespace) -> int:
    if not Path(args.output).resolve().parent.is_dir():
        raise UsageError(f"the folder of {args.output!r} does not exist")
    file_id = args.id
    if args.merged:
        if not _is_batch_id(args.id) or args.errors:
            raise UsageError("--merged needs a batch id (and no --errors)")
        path = client.download_merged_results_to(args.id, args.output)
        size = count_of(path.stat().st_size, "byte")
        _say(f"wrote {path} ({size}: the merged results of {args.id} and its retries)")
        return EXIT_OK
    if _is_batch_id(args.id):
        batch = client.get_batch(args.id)
        kind = "error" if args.errors else "output"
        file_id = batch.get(f"{kind}_file_id")
        if not file_id:
            _say(f"batch {args.id} ({batch.get('status')}) has no {kind} file")
            return EXIT_BATCH_FAILED
    elif args.errors:
        raise UsageError("--errors needs a batch id, not a file id")
    path = client.download_file_to(file_id, args.output)
    _say(f"wrote {path} ({count_of(path.stat().st_size, 'byte')} of {file_id})")
    return EXIT_OK


def _tail(client: BatchGenHttpClient, args: argparse.Namespace) -> int:
    for line in client.follow_results(args.id, poll_interval=args.poll_interval, errors=args.errors):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    return _exit_for(client.get_batch(args.id))


def _watch(client: BatchGenHttpClient, args: argparse.Namespace) -> int:
    batch_ids = args.ids or active_batch_ids(client)
    if not batch_ids:
        _say("no active batches")
        return EXIT_OK
    batches = watch_batches(client, batch_ids, board_for(sys.stderr), poll_interval=args.poll_interval)
    return max(_exit_for(batch) for batch in batches)


def _is_batch_id(identifier: str) -> bool:
    return identifier.startswith("batch_")


def _exit_for(batch: JSONObject) -> int:
    """0 for a completed batch; otherwise say how it ended, and 1."""
    status = batch.get("status")
    if status == "completed":
        return EXIT_OK
    summary = batch_error_summary(batch)
    _say(f"batch {batch.get('id')} ended {status}" + (f": {summary}" if summary else ""))
    return EXIT_BATCH_FAILED


# --- the command line ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The parser of the whole command line; each subcommand's parser sets `command`."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Submit batches to a BatchGen server, follow them and fetch their results.",
        epilog="exit status: 0 ok; 1 batch ended failed/expired/cancelled; 2 usage error; "
        "3 server error; 4 cannot connect; 5 API key refused (401); 6 requests still failed after "
        "submit --retry-failed; 130 interrupted",
        parents=[_global_options(suppress=False)],
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    common = _global_options(suppress=True)

    def add(name: str, command: Command, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text, parents=[common])
        sub.set_defaults(command=command)
        return sub

    submit = add("submit", _submit, "upload a JSONL file, run it as a batch, wait, download the output")
    submit.add_argument("file", metavar="FILE", help="the batch input file (JSONL)")
    submit.add_argument("-o", "--output", required=True, metavar="OUT", help="where to write the output")
    submit.add_argument("--error-output", metavar="PATH", help="where to write failed requests' lines")
    submit.add_argument(
        "--endpoint",
        choices=sorted(ENDPOINTS),
        help="the batch endpoint (default: the url of the file's first request)",
    )
    submit.add_argument(
        "--poll-interval",
        type=non_negative_float,
        metavar="SECONDS",
        help=f"seconds between polls (default: {ADAPTIVE_POLLING})",
    )
    submit.add_argument(
        "--no-progress", action="store_true", help="no progress line (default: shown on a terminal)"
    )
    submit.add_argument(
        "--retry-failed",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="retry what did not succeed up to N times, until nothing retryable is left: a request whose "
        "error no retry can fix (context_length_exceeded, invalid_request, model_not_found, ...) is no "
        "reason to retry; OUT then gets the merged results, every request's best line. Exit status 6 "
        "when requests are still failed at the end (default: 0, no retry)",
    )
    submit.add_argument(
        "--chunked-upload-threshold",
        type=non_negative_int,
        default=DEFAULT_CHUNKED_THRESHOLD,
        metavar="BYTES",
        help="upload a file larger than this through the Uploads API, in 64 MiB parts, so it may be "
        f"larger than the server's limit for one upload (default: {DEFAULT_CHUNKED_THRESHOLD} = 256 MiB)",
    )
    _add_batch_options(submit.add_argument_group("batch options"))

    retry = add(
        "retry",
        _retry,
        "make a new batch over the lines of an ended batch that did not succeed, and print it as JSON",
    )
    retry.add_argument("id", metavar="ID", help="the batch id (its earlier retries count too)")
    retry.add_argument(
        "--only",
        choices=("failed", "not_run"),
        help="only lines whose best result is an error, or only lines that never ran (default: both)",
    )
    retry.add_argument("--wait", action="store_true", help="wait for the retry batch to end")
    retry.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="wait, then write the merged results of ID and its retries (every request's best line) here",
    )
    retry.add_argument(
        "--poll-interval",
        type=non_negative_float,
        metavar="SECONDS",
        help=f"seconds between polls while waiting (default: {ADAPTIVE_POLLING})",
    )
    retry.add_argument("--no-progress", action="store_true", help="no progress line while waiting")
    _add_batch_options(
        retry.add_argument_group("batch options (default: the original batch's)"), keep_defaults=False
    )

    status = add(
        "status",
        _status,
        "print a batch as JSON (and on stderr what the result cache saved it, and a note while it is at risk "
        "of missing its deadline)",
    )
    status.add_argument("id", metavar="ID", help="batch id")

    listing = add("list", _list, "print the batches, newest first, as JSON")
    listing.add_argument("--limit", type=positive_int, metavar="N", help="at most N batches (server max 100)")
    listing.add_argument("--after", metavar="ID", help="the batches after this batch id")

    cancel = add("cancel", _cancel, "cancel a batch and print it as JSON")
    cancel.add_argument("id", metavar="ID", help="batch id")

    download = add("download", _download, "download a batch's output file, or any file, to a path")
    download.add_argument("id", metavar="ID", help="a batch id (its output file) or a file id")
    download.add_argument("-o", "--output", required=True, metavar="OUT", help="where to write it")
    download.add_argument("--errors", action="store_true", help="the batch's error file instead")
    download.add_argument(
        "--merged",
        action="store_true",
        help="the merged results of the batch and its retries (every request's best line, input order)",
    )

    tail = add("tail", _tail, "print a batch's result lines as they are written, until it ends")
    tail.add_argument("id", metavar="ID", help="batch id")
    tail.add_argument("--errors", action="store_true", help="also print the error file's lines")
    tail.add_argument("--poll-interval", type=non_negative_float, default=1.0, metavar="SECONDS")

    watch = add("watch", _watch, "show progress bars (rate, ETA) of batches until they have all ended")
    watch.add_argument("ids", nargs="*", metavar="ID", help="batch ids (default: every batch not ended yet)")
    watch.add_argument("--poll-interval", type=non_negative_float, default=1.0, metavar="SECONDS")

    add("pool", _pool, "print the server's pool status as JSON")
    return parser


def _global_options(*, suppress: bool) -> argparse.ArgumentParser:
    """Options accepted before or after the command. In the subcommands' copy they default to
    SUPPRESS, so that one given before the command is not overwritten by a default."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("connection")
    group.add_argument(
        "--base-url",
        default=default(None),
        metavar="URL",
        help=f"the server (default: ${BASE_URL_ENV}, else {DEFAULT_BASE_URL})",
    )
    group.add_argument(
        "--api-key",
        default=default(None),
        metavar="KEY",
        help=f"the API key (default: ${API_KEY_ENVS[0]}, else ${API_KEY_ENVS[1]}, else none)",
    )
    group.add_argument(
        "--retries",
        type=non_negative_int,
        default=default(5),
        metavar="N",
        help="retries of a request refused (429, 503) or unanswered (default: 5)",
    )
    group.add_argument(
        "--timeout",
        type=positive_float,
        default=default(60.0),
        metavar="SECONDS",
        help="timeout of each HTTP request (default: 60)",
    )
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=default(0),
        help="log every request (retries are always logged)",
    )
    return options


def _add_batch_options(group: argparse._ArgumentGroup, *, keep_defaults: bool = True) -> None:
    """A flag per field of `BatchOptions` (`--max-decoding-length`, …), with its default (or none:
    `retry` takes the original batch's)."""
    for option in fields(BatchOptions):
        flag = flag_of(option)
        name = "--" + option.name.replace("_", "-")
        if flag.pairs:
            group.add_argument(name, type=flag.parse, action="append", metavar=flag.metavar, help=flag.help)
        else:
            help_text = flag.help if keep_defaults else flag.help.split(" (default")[0]
            group.add_argument(
                name,
                type=flag.parse,
                default=option.default if keep_defaults else None,
                metavar=flag.metavar,
                help=help_text,
            )


def _batch_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `BatchOptions` keywords of `submit_batch`, from the parsed flags."""
    values: dict[str, Any] = {}
    for option in fields(BatchOptions):
        value = getattr(args, option.name)
        values[option.name] = dict(value) if flag_of(option).pairs and value is not None else value
    return values


# --- running ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]) and return the exit status."""
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    base_url = args.base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL
    api_key = args.api_key or next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)
    command: Command = args.command
    try:
        with BatchGenHttpClient(
            base_url, timeout=args.timeout, retry=RetryPolicy(max_retries=args.retries), api_key=api_key
        ) as client:
            return command(client, args)
    except UsageError as exc:
        _say(f"error: {exc}")
        return EXIT_USAGE
    except APIStatusError as exc:
        if exc.status_code == 401:
            _say(f"error: {_unauthorized(api_key, exc)}")
            return EXIT_UNAUTHORIZED
        _say(f"error: {_status_error(exc)}")
        return EXIT_SERVER_ERROR
    except APIConnectionError as exc:
        _say(f"error: cannot reach the server at {base_url}: {exc}")
        return EXIT_CANNOT_CONNECT
    except BatchGenClientError as exc:
        _say(f"error: {exc}")
        return EXIT_SERVER_ERROR
    except BrokenPipeError:  # stdout closed early (`batchgen tail ID | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as exc:  # a local file that could not be read or written
        _say(f"error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _status_error(exc: APIStatusError) -> str:
    """The error as the user reads it: a refused batch file's problems one per line, indented."""
    if not exc.line_problems:
        return str(exc)
    head = str(exc).split(": Invalid batch input file: ")[0]
    listed = "\n".join(f"  {problem}" for problem in exc.line_problems)
    return f"{head}: invalid batch input file:\n{listed}"


def _unauthorized(api_key: str | None, exc: APIStatusError) -> str:
    """What to tell the user when the server refused the key (never the key itself)."""
    if api_key is None:
        return (
            f"the server needs an API key ({exc.message or 'HTTP 401'}); pass --api-key KEY or set "
            f"${API_KEY_ENVS[0]}"
        )
    return f"the server refused the API key: {exc.message or 'HTTP 401'} (is it revoked or mistyped?)"


def _configure_logging(verbose: int) -> None:
    """Retries are shown on stderr; with -v, every request too. Only batchgen.client's logger."""
    for old in [h for h in logger.handlers if h.get_name() == PROG]:  # main() run again in-process
        logger.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(PROG)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False


def _print_json(value: object) -> None:
    sys.stdout.write(json.dumps(value, indent=2) + "\n")
    sys.stdout.flush()


def _say(message: str) -> None:
    """A notice or error on stderr, prefixed with the command's name."""
    sys.stderr.write(f"{PROG}: {message}\n")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
