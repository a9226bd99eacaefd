"""The course notebooks run under nbval (``--nbval-lax``: every cell must run), except two
that the suite already runs top to bottom under papermill with their parameters and checks
what they print: ``01_quickstart`` (``tests/test_papermill.py``) and ``04_headless_report``
(``tests/test_course_box.py``, inside a Binder-sized memory box). Running them twice cost the
suite ~25 s."""

collect_ignore = ["01_quickstart.ipynb", "04_headless_report.ipynb"]
