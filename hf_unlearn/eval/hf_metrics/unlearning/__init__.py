"""The evaluate-loadable script lives here (a package so that wheels ship it)."""
