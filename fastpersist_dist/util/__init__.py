"""What every layer uses: errors, configuration, per-process state, timing, progress, wording, and the
quiet mode of the command's processes. Imports nothing else of the package."""
