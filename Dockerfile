# Turnstile: the API, worker and migrate roles in one image.
#   docker build -t turnstile .
#   docker run -e DATABASE_URL=postgresql://... turnstile serve --host 0.0.0.0
#   docker run -e DATABASE_URL=postgresql://... turnstile worker
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md alembic.ini ./
COPY app ./app
COPY alembic ./alembic
# Wheels are built here, so the final image needs no compilers. The otel extra is in: tracing
# stays off (and unloaded) until OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_TRACES_EXPORTER is set.
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[otel]"

FROM python:3.12-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TURNSTILE_HOST=0.0.0.0
RUN useradd --create-home --uid 10001 turnstile
WORKDIR /srv/turnstile
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# The wheel carries the migrations (app/migrations, see setup.py): `migrate` works from here.
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["turnstile"]
CMD ["serve"]
