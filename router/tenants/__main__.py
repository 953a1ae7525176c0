"""`python -m router.tenants`: make API keys' stored forms and tenant secrets."""

from __future__ import annotations

import argparse
import secrets
import sys

from router.tenants.config import hash_key


def main(argv: list[str] | None = None) -> int:
    """`python -m router.tenants hash-key` (the key on stdin, or prompted for) prints its
    stored form; `new-key` a fresh key and its stored form; `new-secret` a random secret."""
    p = argparse.ArgumentParser(prog="python -m router.tenants", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("hash-key", help="read a key from stdin, print 'sha256:<hex>' for the file")
    sub.add_parser("new-key", help="print a new random key and its stored form")
    sub.add_parser("new-secret", help="print a random --tenant-secret")
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.command == "hash-key":
        if sys.stdin.isatty():
            import getpass

            key = getpass.getpass("API key: ")
        else:
            key = sys.stdin.readline().rstrip("\r\n")
        if not key:
            print("no key given", file=sys.stderr)
            return 2
        print(hash_key(key))
    elif args.command == "new-key":
        key = "sk-" + secrets.token_urlsafe(32)
        print(f"key:    {key}\nstored: {hash_key(key)}")
    else:
        print(secrets.token_hex(32))
    return 0


if __name__ == "__main__":
    sys.exit(main())
