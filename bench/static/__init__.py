"""Tables of deviceless compiles (GPU.md, SASS.md, TPU.md) and the cost model
(MODEL.md); the compile harness they use is tests/_deviceless/."""
