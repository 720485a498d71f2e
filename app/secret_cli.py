"""`laneplay secret ...`: the keys that sign owner cookies (`app.owners`), kept in the data directory."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="secret_command", metavar="ACTION", required=True)
    p = sub.add_parser("rotate", help="a new signing key; browsers keep their History (cookies are re-signed on "
                                      "their next page load) unless --drop-old")
    p.add_argument("--drop-old", action="store_true",
                   help="keep only the new key: every cookie issued before stops being an owner (after a leak)")
    sub.add_parser("status", help="where the key file is and how many keys verify")


def run(args: argparse.Namespace) -> int:
    from laneplay.app.owners import KEYS_KEPT, OwnerKeys

    keys = OwnerKeys()
    if args.secret_command == "rotate":
        n = keys.rotate(drop_old=args.drop_old)
        kept = "only the new key verifies: earlier cookies are void" if args.drop_old else \
            f"{n} key(s) verify (at most {KEYS_KEPT}); earlier cookies are re-signed on the next page load"
        print(f"{keys.path}: new signing key; {kept}. A running server picks it up within a second.")
        return 0
    print(f"{keys.path}: {keys.count()} key(s) verify; the newest signs")
    return 0
