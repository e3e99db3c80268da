"""What every package shares and nothing else: user errors (one `error:` line, exit 2), the process's rank, file
hashing. It imports no other package of this repository, so model/, preprocess/ and training/ can all use it."""
