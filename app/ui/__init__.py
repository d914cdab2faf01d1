"""The operator dashboard (`/ui`): server-rendered pages over the queue, in the API's process.

`routes` has the pages and actions, `session` the sign-in cookie and CSRF checks, `views` the
wording of timelines and tables; `templates/` and `static/` are the Jinja2 templates and the
one script and stylesheet. Its reads are the queue's read models (app/queue/reads.py, whose
dashboard statements are app/store/sql/dashboard.sql) and its sign-in sessions app/security's.
"""
