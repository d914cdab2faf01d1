"""The operator dashboard (`/ui`): server-rendered pages over the queue, in the API's process.

`routes` has the pages and actions, `session` the sign-in cookie and CSRF checks, `views` the
wording of timelines and tables, `sql` the dashboard's named statements (`queries.sql`);
`templates/` and `static/` are the Jinja2 templates and the one script and stylesheet.
"""
