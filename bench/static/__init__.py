"""Static (deviceless) compile harnesses: bench.static.gpu (H100/A100 via XLA GPU + ptxas)."""
