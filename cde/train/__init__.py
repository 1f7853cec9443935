"""Training of the reference Steerling model (`python -m cde.train`): data generator, objective,
loop, export. Apart from the serving path: no serving module imports this package."""
