# FastServe on Ray: this repository installed on Ray's own image, for KubeRay (config/kuberay/).
#
#   GPU (A100/H100/H200 nodes, CUDA 13; what rayservice-opt175b.yaml runs):
#     docker build -t fastserve-ray:0.1.0-cu130 .
#   ... with Ray Serve LLM (fastserve.server.llm_server, config/serve-llm-demo.yaml):
#     docker build -t fastserve-ray:0.1.0-cu130-llm --build-arg EXTRAS=gpu,serve-llm .
#   CPU (the kind/minikube demo, rayservice-demo.yaml, and the GPU cluster's CPU-only pods: head
#   and ingress; CPU-only torch, ~1 GB smaller):
#     docker build -t fastserve-ray:0.1.0-cpu --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py312-cpu \
#       --build-arg EXTRAS=cpu --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# One CUDA major in the GPU image: torch 2.13's PyPI wheel is built for CUDA 13.0 (it pulls
# nvidia-nccl-cu13 and cuda-toolkit 13.0), the gpu extra is cupy-cuda13x, and the base is Ray's
# CUDA 13.0 image (Ray tags CUDA x.y as -cuxy0; its CUDA 13 images are built for Python 3.12).
# The GPU nodes need an NVIDIA driver >= 580 (CUDA 13.0's minimum on Linux).
# The Ray version and Python must match pyproject.toml (ray[serve] 2.60, Python >= 3.11) and be
# the same on every node of the cluster: the CPU image above uses the same Ray and Python 3.12.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py312-cu130
FROM ${RAY_IMAGE}

# A pyproject.toml extra: gpu (CuPy kernels for CUDA 13) or cpu (nothing more).
ARG EXTRAS=gpu
# Where torch's wheels come from: PyPI's default build, or PyTorch's CPU index for the demo.
ARG PIP_EXTRA_INDEX_URL=

WORKDIR /home/ray/fastserve
COPY --chown=ray:users . /home/ray/fastserve
# Editable: Serve's import path fastserve.main:build_app resolves config/ (model configs, tokenizer,
# profiles) next to fastserve/, so the package must run from this tree, not from site-packages.
RUN pip install --no-cache-dir -e ".[${EXTRAS}]"
# vLLM's protocol models for the serve-llm extra, without vLLM's own dependency pins
# (config/requirements-nodeps.txt says why); skipped for the other extras.
RUN case ",${EXTRAS}," in *,serve-llm,*) pip install --no-cache-dir --no-deps -r config/requirements-nodeps.txt;; esac

# The CPU decode-attention kernel (fastserve/kernels/cpu/) is compiled on each node at first use, for that
# node's CPU (-march=native); without a C compiler it silently falls back to the 5-11x slower
# torch reference. Ray's images carry none, so gcc (and its OpenMP runtime) go in, and the build
# is tried once here so a broken toolchain fails the image build instead.
USER root
RUN apt-get update && apt-get install -y --no-install-recommends gcc libgomp1 libc6-dev \
    && rm -rf /var/lib/apt/lists/*
USER ray
RUN python -c "from fastserve.kernels import cpu_ops; cpu_ops.build(cpu_ops.PAGED_ATTENTION_SOURCE)"

# Ray 2.60 turns token auth on by default; the manifests hand pods no token, so it is off and
# the Serve endpoint is guarded by our own API key (env FASTSERVE_API_KEY, e.g. from a Secret).
ENV RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
