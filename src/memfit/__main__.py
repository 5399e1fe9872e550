from memfit.cli import run

run()
