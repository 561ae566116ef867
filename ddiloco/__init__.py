"""ddiloco: the application layer (command line, local runner, reports) on top of pipeline/,
store/, workers/ and chaos/."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ddiloco")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"
