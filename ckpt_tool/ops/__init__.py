"""Operations the CLI calls: each takes paths/options and returns a result dataclass."""
