# The gateway alone: slim, non-root, no vLLM inside (vLLM runs in its own image; see deploy/).
# Not built in this repository's CI: the development machines have no Docker engine.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY usefulwork ./usefulwork
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[speed]"

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 usefulwork
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels usefulwork[speed] && rm -rf /wheels
USER usefulwork
WORKDIR /home/usefulwork
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=2s CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz').status==200 else 1)"
ENTRYPOINT ["usefulwork", "serve"]
CMD ["--config", "/etc/usefulwork/config.yaml", "--host", "0.0.0.0", "--port", "8080"]
