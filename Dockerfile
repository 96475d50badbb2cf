FROM python:3.11-slim
WORKDIR /app
COPY . /app
# CPU wheel of torch by default; build with --build-arg TORCH_INDEX=... for CUDA.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir torch --index-url ${TORCH_INDEX} && pip install --no-cache-dir -e .
ENTRYPOINT []
