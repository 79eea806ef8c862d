"""Planning, pure: which rank writes which bytes of a save (``writes``) and which rank reads which bytes
for another in a shared load (``read_sharing``)."""
