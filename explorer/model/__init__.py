"""What the widgets show, computed without Qt: pacing, colours, event wording, block stories, metrics history, the contiguous allocator. Qt-free (tests/test_layering.py)."""
