"""``python -m pipeline STEP [flags]``: the pipeline's steps (prepare, train, verify-resume,
evaluate, stage, publish) once the package is installed, from any folder
(:mod:`pipeline.entry.dispatch`)."""

from pipeline.entry.dispatch import main

if __name__ == "__main__":
    main()
