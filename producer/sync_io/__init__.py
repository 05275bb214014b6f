"""The blocking I/O side of the producer: the driver that runs ``core`` plans on a
``redis.Redis``, and the pub/sub subscriber with its reader thread."""
