"""Pure cost models: bytes, FLOPs and seconds (design §3, §5, §7.2, §10). No state, no I/O."""
