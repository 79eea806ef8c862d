"""How bytes move: DeepSpeed aio writes and verified reads."""
