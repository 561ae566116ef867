"""``ddiloco keys``: the CURVE key pairs of a run's workers (docs/SECURITY.md).

* ``ddiloco keys new NAME ... [--dir DIR] [--force | --exist-ok]``: a key pair per worker;
* ``ddiloco keys list [--dir DIR]``: the allow-list, every public certificate by worker id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ddiloco.pipeline.errors import DDilocoError
from ddiloco.workers.cli import guard, new_app

keys_app = new_app("CURVE key pairs of workers (docs/SECURITY.md)")


@keys_app.command("new")
def keys_new(
    names: Annotated[list[str], typer.Argument(
        metavar="NAME", help="worker ids, e.g. learner-0 shard-0")],
    keys_dir: Annotated[Path, typer.Option("--dir", help="key directory")] = Path("keys"),
    force: Annotated[bool, typer.Option("--force", help="replace existing keys")] = False,
    exist_ok: Annotated[bool, typer.Option("--exist-ok", help="keep existing keys (e.g. a "
                                           "deployment's init step run again)")] = False,
) -> None:
    """Create a key pair per worker: DIR/NAME.key (public, the allow-list) and
    DIR/private/NAME.key_secret (mode 0600; give it to that worker only)."""
    def go() -> int:
        from ddiloco.pipeline.security import create_keys, load_keys

        for name in names:
            if exist_ok and not force and (keys_dir / "private" / f"{name}.key_secret").exists():
                kp = load_keys(keys_dir, name)
            else:
                kp = create_keys(keys_dir, name, overwrite=force)
            typer.echo(f"{name}: {kp.public.decode()}  ({keys_dir}/{name}.key)")
        return 0

    guard(go)


@keys_app.command("list")
def keys_list(
    keys_dir: Annotated[Path, typer.Option("--dir", help="key directory")] = Path("keys"),
) -> None:
    """The allow-list: every public certificate in DIR, by worker id."""
    def go() -> int:
        from ddiloco.pipeline.security import allow_list

        # allow_list reads a missing directory as an empty one (it admits nobody); here that
        # is a mistyped --dir.
        if not keys_dir.is_dir():
            reason = "not a directory" if keys_dir.exists() else "no such key directory"
            raise DDilocoError(f"{keys_dir}: {reason}")
        listed = allow_list(keys_dir)
        if not listed:
            typer.echo(f"no public keys in {keys_dir} (create them with `ddiloco keys new "
                       f"NAME --dir {keys_dir}`)", err=True)
        for public, name in sorted(listed.items(), key=lambda kv: kv[1]):
            typer.echo(f"{name}\t{public.decode()}")
        return 0

    guard(go)
