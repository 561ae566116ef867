"""ddiloco workers package."""
