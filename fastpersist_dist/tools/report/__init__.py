"""``fastpersist-dist report``: the docs' benchmark tables, measured, saved as JSON and rendered into the docs'
``<!-- report: NAME begin/end -->`` blocks (``command``: the run; ``environment``: the stamp; ``render``:
JSON to markdown; ``blocks``: the blocks of a page)."""
