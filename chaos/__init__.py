"""Chaos runs: fault injection, token-fate accounting and the post-run audit (DESIGN §5)."""

if __name__ != "ddiloco.chaos":
    # Run from a checkout, the folder is also importable as ``chaos``: a second copy of every
    # module would then hold a second copy of its state.
    raise ImportError(f"{__name__!r} is the package 'ddiloco.chaos': import it by that name "
                      "(pip install -e . maps the chaos/ folder there)")

