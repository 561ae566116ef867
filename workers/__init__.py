"""ddiloco workers package."""

if __name__ != "ddiloco.workers":
    # Run from a checkout, the folder is also importable as ``workers``: a second copy of every
    # module would then hold a second copy of its state.
    raise ImportError(f"{__name__!r} is the package 'ddiloco.workers': import it by that name "
                      "(pip install -e . maps the workers/ folder there)")

