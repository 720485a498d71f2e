"""`laneplay db ...`: schema maintenance. The app upgrades on start anyway; this is for operators."""
from __future__ import annotations

import argparse

URL_HELP = "SQLAlchemy URL (default: $LANEPLAY_DATABASE_URL, else $LANEPLAY_DATA_DIR/laneplay.db, data dir ./data)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    p = sub.add_parser("upgrade", help="migrate the database to the newest schema (or --revision)")
    p.add_argument("--url", help=URL_HELP)
    p.add_argument("--revision", default="head", help="target revision (default: head)")
    p = sub.add_parser("current", help="print the database's schema revision and the newest one")
    p.add_argument("--url", help=URL_HELP)


def run(args: argparse.Namespace) -> int:
    from sqlalchemy.engine import make_url

    from laneplay.storage import db

    where = make_url(db.database_url(args.url)).render_as_string(hide_password=True)
    if args.db_command == "upgrade":
        print(f"{where}: schema at revision {db.upgrade(args.url, args.revision)}")
        return 0
    rev, newest = db.current(args.url), db.head()
    print(f"{where}: schema at revision {rev or '(empty)'}; newest is {newest}")
    return 0 if rev == newest else 1
