"""The compiled step explained: memory at the peak, unasked collectives, placement against
intent, fixes proven by compiling them (``sx.explain``)."""
