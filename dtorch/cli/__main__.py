from dtorch.cli import console

console()
