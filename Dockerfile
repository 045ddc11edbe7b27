# GPU image: the official PyTorch CUDA runtime image carries torch, CUDA and cuDNN; pip adds
# the rest of the project. Keep the tag's torch version inside pyproject's torch range, so
# that pip keeps the image's torch instead of downloading another one.
#   docker build -t cifar-amp .
#   docker run --gpus all -v "$PWD/data:/workspace/data" -v "$PWD/logs:/workspace/logs" \
#     cifar-amp python train.py precision=16-mixed
# The image runs as uid 1000; if you are another uid, add --user "$(id -u):$(id -g)" -e HOME=/tmp
# so that what lands in logs/ is yours.
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /workspace

# Dependencies first (cached while only the code changes), then the package itself.
COPY pyproject.toml README.md ./
COPY src ./src
# The project itself; its dependencies' versions are ranged in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install ".[sweeps]"

COPY configs ./configs
COPY train.py eval.py ./

RUN useradd --create-home --uid 1000 trainer \
    && mkdir -p data logs \
    && chown 1000:1000 data logs
USER 1000:1000

# Datasets and run outputs live outside the image.
VOLUME ["/workspace/data", "/workspace/logs"]

CMD ["python", "train.py", "precision=16-mixed"]
