"""Reading dumps: the reader (`reader.DumpFile`), its low-level fast paths, recovery of files
left by a killed writer, the original Ascend layout's rules, and the safety checks every open
goes through (hostile files: external links/storage, virtual datasets, non-regular files,
size and filter caps)."""
