"""nanopara: a Triton-kernel-centric minimal GPT-2 trainer with hand-written parallelism."""
