"""ddiloco pipeline package."""
