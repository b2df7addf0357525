"""`python -m dataflow ...` == `dataflow ...` (for machines where the console script is not installed)."""
from dataflow.cli import main

main()
