"""``batchgen-server keys …``: create, list and revoke API keys, and change a tenant's limits.

It writes the same metadata database a running server reads (``--storage-path``, or
``--metadata-url`` for replicas sharing PostgreSQL), and a running server sees every change on its
next request (replicas within half a second): a revoked key stops working then.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from batchgen.core.tenancy import TenantLimits, reserved_tenant_problem
from batchgen.server.api_keys import check_tenant_name, open_key_store
from batchgen.server.settings import ServerSettings

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NOT_FOUND = 1
EXIT_UNAVAILABLE = 3


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}") from exc
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def _tenant(text: str) -> str:
    """A tenant name as given; refused: a malformed one, or a reserved one (``default``)."""
    try:
        name = check_tenant_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    reserved = reserved_tenant_problem(name)
    if reserved is not None:
        raise argparse.ArgumentTypeError(reserved)
    return name


def _add_storage(parser: argparse.ArgumentParser) -> None:
    default = str(ServerSettings().storage_path)
    parser.add_argument(
        "--storage-path",
        default=default,
        help=f"the server's storage folder, where its metadata database is (default: {default})",
    )
    parser.add_argument(
        "--metadata-url",
        help="the PostgreSQL database replicas share (postgresql://USER:PASSWORD@HOST:PORT/DB), as "
        "given to their --metadata-url; instead of --storage-path",
    )


def _add_limits(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-queued-requests",
        type=_non_negative_int,
        help="most requests the tenant's batches may have waiting for a slot; a batch that would go over "
        "it gets 429 until earlier ones drain, one larger than the limit itself 400 (it can never fit) "
        "(default: no limit beyond the server's)",
    )
    parser.add_argument(
        "--max-active-batches",
        type=_non_negative_int,
        help="most batches the tenant may have not ended yet; one more gets 429 (at 0, every batch "
        "gets 400) (default: no limit)",
    )
    parser.add_argument(
        "--max-stored-bytes",
        type=_non_negative_int,
        help="most bytes the tenant may hold in files it uploaded and in parts of uploads (POST "
        "/v1/uploads) not completed yet; more gets 413 (default: no limit)",
    )
    parser.add_argument(
        "--weight",
        type=_weight,
        default=None,
        help="the tenant's share of the slots while other tenants have work too (default: 1)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchgen-server keys",
        description="Manage the API keys and tenants of a BatchGen server. Once a key exists, every "
        "/v1 call needs one (Authorization: Bearer KEY).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser(
        "create", help="make a key for a tenant (made if new); the key is printed on the last line"
    )
    create.add_argument(
        "--tenant",
        required=True,
        type=_tenant,
        help="the tenant the key acts for ('default' is reserved: it owns what is made without a key)",
    )
    create.add_argument(
        "--admin", action="store_true", help="an admin key sees and manages every tenant's files and batches"
    )
    _add_limits(create)
    _add_storage(create)
    listing = commands.add_parser(
        "list", help="show keys (id, tenant, admin, created, last used; never secrets)"
    )
    _add_storage(listing)
    revoke = commands.add_parser("revoke", help="revoke a key by its id; a running server refuses it at once")
    revoke.add_argument("id", help="the key id, as 'keys list' shows it")
    _add_storage(revoke)
    limits = commands.add_parser(
        "set-limits", help="replace a tenant's limits and weight (a limit not given is removed)"
    )
    limits.add_argument("--tenant", required=True, type=_tenant, help="the tenant ('default' is reserved)")
    _add_limits(limits)
    _add_storage(limits)
    return parser


def _limits(args: argparse.Namespace) -> TenantLimits:
    return TenantLimits(
        max_queued_requests=args.max_queued_requests,
        max_active_batches=args.max_active_batches,
        max_stored_bytes=args.max_stored_bytes,
        weight=1.0 if args.weight is None else args.weight,
    )


def _when(moment: int | None) -> str:
    return "-" if moment is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(moment))


def _limit(value: int | None) -> str:
    return "-" if value is None else str(value)


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    where = "the shared database" if args.metadata_url else str(Path(args.storage_path) / "metadata.sqlite3")
    try:
        store = open_key_store(Path(args.storage_path), args.metadata_url)
    except Exception as exc:  # an unreachable database, a missing driver: said plainly, no traceback
        print(f"batchgen-server keys: cannot open the keys in {where}: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        if args.command == "create":
            given = any(
                value is not None
                for value in (
                    args.max_queued_requests,
                    args.max_active_batches,
                    args.weight,
                    args.max_stored_bytes,
                )
            )
            key_id, key = store.create_key(
                args.tenant, admin=args.admin, limits=_limits(args) if given else None
            )
            kind = "admin key" if args.admin else "key"
            print(f"Created {kind} {key_id} for tenant '{args.tenant}' in {where}.")
            print("Keep it secret; it is shown only now. The key:")
            print(key)
        elif args.command == "list":
            limits = {tenant.name: tenant.limits for tenant in store.tenants()}
            print(f"{'ID':<14} {'TENANT':<20} {'ADMIN':<6} {'CREATED':<21} {'LAST USED':<21} {'REVOKED':<21}")
            for record in store.list_keys():
                print(
                    f"{record.id:<14} {record.tenant:<20} {'yes' if record.admin else 'no':<6} "
                    f"{_when(record.created_at):<21} {_when(record.last_used_at):<21} {_when(record.revoked_at):<21}"
                )
            print()
            print(f"{'TENANT':<20} {'MAX QUEUED':<11} {'MAX BATCHES':<12} {'WEIGHT':<7} MAX STORED BYTES")
            for name, tenant_limits in limits.items():
                print(
                    f"{name:<20} {_limit(tenant_limits.max_queued_requests):<11} "
                    f"{_limit(tenant_limits.max_active_batches):<12} {tenant_limits.weight:<7g} "
                    f"{_limit(tenant_limits.max_stored_bytes)}"
                )
        elif args.command == "revoke":
            if not store.revoke(args.id):
                print(f"batchgen-server keys: no active key with id {args.id!r}", file=sys.stderr)
                return EXIT_NOT_FOUND
            print(f"Revoked key {args.id}.")
        else:
            try:
                store.set_limits(args.tenant, _limits(args))
            except KeyError:
                print(
                    f"batchgen-server keys: no tenant {args.tenant!r} (create a key for it first)",
                    file=sys.stderr,
                )
                return EXIT_NOT_FOUND
            print(f"Set the limits of tenant '{args.tenant}'.")
    finally:
        store.close()
    return EXIT_OK
