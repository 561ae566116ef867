"""ddiloco pipeline package."""

if __name__ != "ddiloco.pipeline":
    # Run from a checkout, the folder is also importable as ``pipeline``: a second copy of every
    # module would then hold a second copy of its state.
    raise ImportError(f"{__name__!r} is the package 'ddiloco.pipeline': import it by that name "
                      "(pip install -e . maps the pipeline/ folder there)")

