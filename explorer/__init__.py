"""The Qt front end of the paged KV-cache explorer.

It reads immutable engine snapshots and sends commands through an EngineRunner; it never reaches into the engine's
internals, so the engine stays usable headless and the GUI can never see a half-updated pool.
"""

from .qt_compat import make_singletons_immortal

make_singletons_immortal()
