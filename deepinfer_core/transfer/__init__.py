"""KV transfer plane: moves paged KV blocks between engines in different processes (NIXL)."""
