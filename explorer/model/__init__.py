"""The window's model, without Qt: the source every panel reads (PoolSource) and its step cursor, the frame
timer's pace, colours, event wording, block stories, metrics history, the contiguous allocator. Qt-free
(tests/test_layering.py)."""
