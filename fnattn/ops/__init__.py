"""Pure-torch functional math for recurrent attention layers (one request at a time)."""
